"""The torchrun runs of mesh_worker.py, each launched once a run and shared by test_materialize.py,
test_sharding.py and test_checkpoint_dcp.py: a launch of 4 ranks costs 10-20 s. A fixture scoped to the run is per
pytest-xdist worker, so those files mark their tests ``xdist_group("torchrun_mesh")`` and the Makefile runs
``--dist loadgroup``: one worker runs them, and each run launches once."""
import os

import pytest
import torch

import test_distributed

WORKER = os.path.join(os.path.dirname(__file__), "mesh_worker.py")


def launched(scenario: str, world: int, out_dir, **env) -> list[dict]:
    """Each rank's results of ``scenario`` run on ``world`` ranks writing into ``out_dir``."""
    saved, test_distributed.WORKER = test_distributed.WORKER, WORKER
    try:
        run = test_distributed.launch(scenario, world, out_dir, timeout=300, **env)
    finally:
        test_distributed.WORKER = saved
    assert run.codes == [0] * world, run.log()
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="session")
def torchrun_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mesh")


@pytest.fixture(scope="session")
def mesh_run(torchrun_dir) -> list[dict]:
    """4 ranks as pp=2 x dp_shard=2 (mesh_worker.mesh_scenario); its DCP checkpoint in ``torchrun_dir / "ckpt"``."""
    return launched("mesh", 4, torchrun_dir)


@pytest.fixture(scope="session")
def pp_run(torchrun_dir, mesh_run) -> list[dict]:
    """2 ranks at pp=2 (mesh_worker.pp_scenario), after mesh_run saved its checkpoint, with a Llama's safetensors
    shards written here first (``llama_checkpoint``)."""
    from test_checkpoint_dcp import llama_checkpoint
    llama_checkpoint(torchrun_dir)
    out = torchrun_dir / "pp"
    out.mkdir()
    return launched("pp", 2, out, CHECKPOINTS=torchrun_dir)
