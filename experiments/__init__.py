"""The runners: ``python -m experiments.<name>`` (absl flags; ``--help`` lists them).

Quiet by default: JAX's platform probe logs "Unable to initialize backend 'tpu'" at INFO on every CPU run;
that logger is raised to WARNING here unless absl's ``--verbosity`` (``-v``) is given.
"""
import logging as _logging
import sys as _sys

if not any(a.startswith(("--verbosity", "-v", "--v=")) for a in _sys.argv[1:]):
    _logging.getLogger("jax._src.xla_bridge").setLevel(_logging.WARNING)
