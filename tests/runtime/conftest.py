"""The torchrun runs of mesh_worker.py, each launched once a run and shared by test_materialize.py,
test_sharding.py and test_checkpoint_dcp.py: a launch of 4 ranks costs 10-20 s. A fixture scoped to the run is per
pytest-xdist worker, so each launch runs under a file lock in a folder both workers share: the first worker to need
it launches, the other reads the ranks' results it wrote."""
import os

import pytest
import torch

import test_distributed

WORKER = os.path.join(os.path.dirname(__file__), "mesh_worker.py")
HSDP_WORLD = 8  # dp_replicate=2 x dp_shard=2 x pp=2


def launched(scenario: str, world: int, out_dir, **env) -> list[dict]:
    """Each rank's results of ``scenario`` run on ``world`` ranks writing into ``out_dir``."""
    run = test_distributed.launch(scenario, world, out_dir, timeout=300, worker=WORKER, **env)
    assert run.codes == [0] * world, run.log()
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def once(folder, launch) -> list[dict]:
    """``launch(folder)`` under a lock, unless another pytest-xdist worker already ran it: then its results."""
    from filelock import FileLock
    with FileLock(str(folder) + ".lock"):
        done = folder / "done"
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            launch(folder)
            done.touch()
    return [torch.load(path, weights_only=False) for path in sorted(folder.glob("rank*.pt"))]


@pytest.fixture(scope="session")
def torchrun_dir(tmp_path_factory):
    """The run's own folder (under pytest-xdist, the one every worker's folder is in)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "mesh"


@pytest.fixture(scope="session")
def mesh_run(torchrun_dir) -> list[dict]:
    """4 ranks as pp=2 x dp_shard=2 (mesh_worker.mesh_scenario); its DCP checkpoint in ``torchrun_dir / "ckpt"``."""
    return once(torchrun_dir, lambda folder: launched("mesh", 4, folder))


@pytest.fixture(scope="session")
def hsdp_run(torchrun_dir) -> list[dict]:
    """HSDP_WORLD ranks as dp_replicate=2 x dp_shard=2 x pp (mesh_worker.hsdp_scenario)."""
    return once(torchrun_dir / "hsdp", lambda folder: launched("hsdp", HSDP_WORLD, folder))


@pytest.fixture(scope="session")
def pp_run(torchrun_dir, mesh_run) -> list[dict]:
    """2 ranks at pp=2 (mesh_worker.pp_scenario), after mesh_run saved its checkpoint, with a Llama's safetensors
    shards written into ``torchrun_dir`` first (``llama_checkpoint``)."""
    from test_checkpoint_dcp import llama_checkpoint

    def launch(folder):
        llama_checkpoint(torchrun_dir)
        launched("pp", 2, folder, CHECKPOINTS=torchrun_dir)
    return once(torchrun_dir / "pp", launch)
