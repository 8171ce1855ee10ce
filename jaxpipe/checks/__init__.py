"""Everything jaxpipe checks, in one room (nothing is imported here: :mod:`.values` is JAX-free and the
schedule IR, which never imports JAX, reads it).

* :mod:`.values` -- pure-Python value checks every layer shares (an integer, a path a file is in the way of);
* :mod:`.arguments` -- ``jp.Pipeline``'s arguments: the optimizer, the mesh, the scalars, ``residuals=``,
  ``op_costs=``, ``options=`` and the keywords of the unreleased 0.1.0;
* :mod:`.batch` -- a batch's values on the host (NaN / Inf, integer ids in range), before it reaches a
  program;
* :mod:`.on_device` -- what a step checks on the device without making the host wait (its status vector, the
  state a refused step keeps, the values a refusal follows);
* :mod:`.diagnose` -- where a NaN or Inf came from: the first stage whose weights, output or gradient is not
  finite.

Errors are :class:`jaxpipe.ConfigError` (:mod:`jaxpipe.errors`): which value, why, and what would work.
"""
