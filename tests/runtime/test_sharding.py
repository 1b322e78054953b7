"""FSDP2 over each stage of a pipeline (runtime/sharding.py, runtime/mesh.py): ``autopipe.compile(model, mesh=mesh)``
with a DeviceMesh of dims "pp" x "dp_shard", 4 gloo ranks, the float64 GPT whose LM head is tied to its embedding
(on the first and the last stage), the loop a user writes (1F1B, AdamW, ``pipe.clip_grad_norm_`` active every step):
the plain model's parameters and total norms, each rank holding half its stage between steps, FSDP2's collectives
once a step; bad meshes and FSDP2 on top of autopipe's refused by name. The run is conftest.py's ``mesh_run``;
``data_parallel=D`` on the same engine: test_distributed.py's test_pipeline_times_data_parallel."""
import pytest
import torch

from mesh_worker import HSDP_ROWS, LR, MAX_NORM, NEW_LENGTHS, batch, gpt64, lm_loss


def plain_training(steps: int, rows: int = 8):
    """The plain model trained in one process on every step's whole batch: parameters after each step, losses, norms."""
    model = gpt64()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params, losses, norms = [], [], []
    for step in range(steps):
        ids, target = batch(step, rows)
        loss = lm_loss(model(ids), target)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
    return params, losses, norms


def test_pp2_x_dp_shard2_trains_as_the_plain_model(mesh_run):
    params, losses, norms = plain_training(3)
    assert min(norms) > 10 * MAX_NORM  # clipping is active
    assert [(r["stage"], r["dp"]) for r in mesh_run] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    seen = set()
    for r in mesh_run:
        assert r["norms"] == pytest.approx(norms, rel=1e-12), "every rank scales by the plain model's total norm"
        for name, p in r["after3"].items():
            torch.testing.assert_close(p, params[-1][name], rtol=0, atol=1e-10, msg=name)
            seen.add(name)
    assert seen == set(params[-1])  # every parameter, the tied head under both names
    # each data-parallel rank of the last stage reports its half's loss: their mean is the plain model's
    halves = [r["losses"] for r in mesh_run if r["stage"] == 1]
    assert [(a + b) / 2 for a, b in zip(*halves)] == pytest.approx(losses, rel=1e-12)


@pytest.mark.parametrize("schedule,stages", [("interleaved", [[0, 2], [1, 3]]), ("zbv", [[0, 3], [1, 2]])])
def test_two_stages_a_rank_under_fsdp2_train_as_the_plain_model(mesh_run, schedule, stages):
    """Interleaved and zbv (its backward split in two) at pp=2 x dp_shard=2: a rank's two stages are one FSDP2 group;
    the tied embedding and head on one rank (zbv) or two (interleaved); 3 steps, clipping active."""
    params, losses, norms = plain_training(3)
    for r in mesh_run:
        run = r[schedule]
        assert run["stages"] == stages[r["stage"]]
        assert run["local_elements"] * 2 == run["full_elements"]
        assert run["norms"] == pytest.approx(norms, rel=1e-12)
        for name, p in run["after3"].items():
            torch.testing.assert_close(p, params[-1][name], rtol=0, atol=1e-10, msg=f"{schedule}: {name}")
    halves = [r[schedule]["losses"] for r in mesh_run if r["stage"] == (1 if schedule == "interleaved" else 0)]
    assert [(a + b) / 2 for a, b in zip(*halves)] == pytest.approx(losses, rel=1e-12)


def test_hsdp_dp_replicate2_x_dp_shard2_on_a_pipeline_trains_as_the_plain_model(hsdp_run):
    """HSDP: FSDP2 over (dp_replicate, dp_shard), the parameters sharded over dp_shard and replicated over
    dp_replicate, 4 data-parallel pipelines each on a quarter of the batch; 3 steps, clipping active."""
    params, losses, norms = plain_training(3, HSDP_ROWS)
    assert sorted(r["dp"] for r in hsdp_run if r["stage"] == 0) == [0, 1, 2, 3]
    seen = set()
    for r in hsdp_run:
        assert r["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert r["local_elements"] * 2 == r["full_elements"]
        assert r["norms"] == pytest.approx(norms, rel=1e-12)
        for name, p in r["after3"].items():
            torch.testing.assert_close(p, params[-1][name], rtol=0, atol=1e-10, msg=name)
            seen.add(name)
    assert seen == set(params[-1])
    last = max(r["stage"] for r in hsdp_run)
    quarters = [r["losses"] for r in sorted(hsdp_run, key=lambda r: r["dp"]) if r["stage"] == last]
    assert [sum(q) / 4 for q in zip(*quarters)] == pytest.approx(losses, rel=1e-12)


def test_between_steps_a_rank_holds_half_its_stage_and_a_step_gathers_once(mesh_run):
    """FSDP2 with the parameters gathered once a step and the gradients reduce-scattered once, after the step's last
    backward (4 micro-batches); the one all-reduce is the tied embedding's, over its two holders."""
    for r in mesh_run:
        assert r["grad_type"] == "DTensor"
        assert r["local_elements"] * 2 == r["full_elements"]
        assert r["collectives"] == [{"all_gather_single": 1, "reduce_scatter_single": 1, "all_reduce": 1}] * 3


@pytest.mark.parametrize("case,message", [
    ("no pp", "the mesh has dims {'dp_shard': 4} but no 'pp' dim"),
    ("balance", "balance gives 3 stages but the pipeline has 2 (pp size 2"),
    ("user fsdp", "GPT.blocks.0 is already an FSDP2 module (fully_shard)"),
    ("user fsdp on top", "is wrapped in FSDP2 (fully_shard) by the caller: autopipe shards")])
def test_bad_input_is_refused_naming_the_dim_and_sizes(mesh_run, case, message):
    for r in mesh_run:
        assert r["refused"][case].startswith("ValueError: ") and message in r["refused"][case], r["refused"][case]
        assert r["refused"]["user fsdp on autopipe's"] != "not refused"  # fully_shard itself refuses


def test_a_new_length_a_step_other_on_each_data_parallel_rank_trains_as_ddp_does(mesh_run):
    """Dynamic padding per rank under FSDP2: a fourth step at sequence lengths 12 and 10 on the two data-parallel
    pipelines (a new program each, whose stages follow the parameters FSDP2 gathers on the first program's): the
    plain model's step on the mean of the two pipelines' losses, as DDP averages them, to 1e-10."""
    model = gpt64()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(4):
        ids, target = batch(step)
        if step < 3:
            loss = lm_loss(model(ids), target)
        else:
            parts = [(i.chunk(2)[k][:, :n], t.chunk(2)[k][:, :n]) for k, n, i, t in
                     zip(range(2), NEW_LENGTHS, [ids] * 2, [target] * 2)]
            losses = [lm_loss(model(i), t) for i, t in parts]
            loss = sum(losses) / 2
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        opt.step()
        opt.zero_grad()
    plain = dict(model.named_parameters(remove_duplicate=False))
    for r in mesh_run:
        assert r["new_shape_norm"] == pytest.approx(norm, rel=1e-12)
        if r["stage"] == 1:
            assert r["new_shape_loss"] == pytest.approx(losses[r["dp"]].item(), rel=1e-12)
        for name, p in r["after_new_shape"].items():
            torch.testing.assert_close(p, plain[name], rtol=0, atol=1e-10, msg=name)
