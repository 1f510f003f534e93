"""`mesh.pipeline > 1` runs the pipelined step through the ordinary training loop."""

import numpy as np
from helpers import mesh_of, small_config

from gendist.presets import replace
from gendist.training import loop


def test_loop_runs_pipelined_and_matches_plain(tmp_path):
    base = small_config(str(tmp_path / "plain"), steps=3, batch_size=8)
    plain = loop.run(base, mesh=mesh_of(4, data=4), log=lambda *a: None)
    piped_cfg = replace(small_config(str(tmp_path / "pipe"), steps=3, batch_size=8,
                                     pipeline_schedule="1f1b", pipeline_microbatches=2),
                        **{"mesh.pipeline": 2})
    piped = loop.run(piped_cfg, mesh=mesh_of(8, data=4, pipeline=2), log=lambda *a: None)
    np.testing.assert_allclose([h["loss"] for h in piped.history],
                               [h["loss"] for h in plain.history], rtol=1e-5)
    assert piped.setup.traces["step"] == 1
    np.testing.assert_allclose(piped.val_loss, plain.val_loss, rtol=1e-5)
