"""A rank holds its own stages and nothing else (runtime/materialize.py): after compile under torchrun each rank's
tensors are its stages' share, on its device, for a model on the CPU or on meta, on the fx and the export route; a
meta model's non-persistent buffers get their constructor's value or a refusal naming them; ``pipe.state_dict()`` has
the model's own keys. The torchrun runs are conftest.py's; the device choice and CUDA placement run here without a
GPU (placement on meta under FakeTensorMode, as tests/test_placement.py does)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopipe.options import Options
from autopipe.pass_chain import run_passes
from autopipe.runtime import materialize
from mesh_worker import Rope
from zoo import GPT

ROUTES = ("cpu fx", "meta fx", "cpu export", "meta export")


@pytest.mark.parametrize("name", ROUTES)
def test_after_compile_a_rank_holds_its_stages_tensors_alone(pp_run, name):
    """Every tensor alive in a rank's process, less what it held before building the model: at most 1.15x the bytes
    of its own stages' parameters and buffers, all on its device; the other stages' tensors are on meta."""
    for rank, results in enumerate(pp_run):
        r = results[name]
        assert r["route"] == name.split()[1]
        assert r["held"] <= 1.15 * r["share"], (rank, r["held"], r["share"])
        assert r["devices"] == ["cpu"] and r["on_meta"] > 0


@pytest.mark.parametrize("name", ROUTES)
def test_the_pipelines_state_dict_has_the_models_own_keys(pp_run, name):
    """Each rank's keys are the model's, none of a rank's own: the union is the model's state dict, a tied weight under
    both its names on each rank that holds it; no buffer the model leaves out of its state dict (fx registers every
    tensor a get_attr reads as a persistent buffer)."""
    keys = [set(r[name]["keys"]) for r in pp_run]
    model_keys = set(pp_run[0][name]["model_keys"])
    assert all(k <= model_keys for k in keys)
    assert keys[0] | keys[1] == model_keys
    assert keys[0] & keys[1] == {"wte.weight", "lm_head.weight"}


def test_a_non_persistent_buffer_built_on_meta_gets_its_constructors_value(pp_run):
    """Rope keeps what its constructor takes: built again on each rank, its inv_freq is the plain model's, exactly,
    and out of the state dict, as in the model's."""
    want = Rope(16).inv_freq
    for r in pp_run:
        assert torch.equal(r["Rope"]["inv_freq"], want)
        assert not any("inv_freq" in k for k in r["Rope"]["keys"])


@pytest.mark.parametrize("table,why", [("Noisy", "draws it at random"), ("Forgetful", "does not keep")])
def test_a_non_persistent_buffer_autopipe_cannot_know_is_refused_by_name(pp_run, table, why):
    for r in pp_run:
        assert r[table].startswith("ValueError: the non-persistent buffer rope.inv_freq") and why in r[table]


def test_the_default_device_is_this_local_ranks_gpu_where_cuda_is_present(monkeypatch):
    model = GPT(vocab=16, d=8, heads=2, layers=1, block=4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert materialize.rank_device(None, model) == torch.device("cpu")
    assert materialize.rank_device("cuda", model) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert materialize.rank_device(None, model) == torch.device("cuda", 1)
    assert materialize.rank_device("cpu", model) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="local rank 2 would run on cuda:2, but this host has 2 GPU"):
        materialize.rank_device(None, model)


@pytest.mark.parametrize("route", ["fx", "export"])
def test_a_ranks_stage_placed_on_another_device_reads_only_tensors_there(route):
    """A CPU model's first stage placed on meta (standing for the rank's GPU): every tensor it reads moved there, one
    tensor for the tied embedding and head in the model and the stage, the other stage's tensors left on meta and
    the stage itself replaced; the stage then runs under FakeTensorMode with its inputs on meta, where a tensor left
    on the CPU would raise FakeTensorDeviceMismatchError as on a GPU."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=2, block=16, dropout=0.0)
    ids = torch.randint(0, 64, (4, 16))
    meta = torch.device("meta")
    held = {}

    def hold(stages):
        held["moved"] = materialize.hold_only(model, stages, [0], meta, rank=0)
        held["stages"] = list(stages)
    run_passes(model, (ids,), {}, Options.make([meta, meta], chunks=2, route=route), after_codegen=hold)
    stage, other = held["stages"]
    assert isinstance(other, materialize.Elsewhere)
    assert {t.device for t in (*stage.parameters(), *stage.buffers())} == {meta}
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert model.wte.weight is model.lm_head.weight and any(p is model.wte.weight for p in stage.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outputs = stage(mode.from_tensor(ids).to(meta))
    assert {o.device for o in outputs if isinstance(o, torch.Tensor)} == {meta}
