"""Issue #52 item 2: the learning-rate schedules by name (a run's config file, TensorBoard events and its
learning rate per step are checked on the user's own model in ``test_own_model_in_trainer``)."""

import numpy as np
import pytest

import jaxpipe as jp


@pytest.mark.parametrize("name", sorted(jp.optim.SCHEDULES))
def test_every_named_schedule_warms_up_linearly_then_never_exceeds_its_peak(name):
    s = jp.optim.schedule_by_name(name, 2.0, 40, warmup=0.1)
    lr = np.asarray([float(s(i)) for i in range(41)])
    np.testing.assert_allclose(lr[:5], [0.0, 0.5, 1.0, 1.5, 2.0], rtol=1e-6)
    assert lr.max() <= 2.0 + 1e-6 and lr[4] == pytest.approx(2.0)
    with pytest.raises(jp.ConfigError, match="unknown learning-rate schedule"):
        jp.optim.schedule_by_name("cosin", 1.0, 10)
