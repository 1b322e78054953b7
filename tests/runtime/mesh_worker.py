"""One rank of the torchrun scenarios inside torch's distributed stack (test_materialize.py, test_sharding.py,
test_checkpoint_dcp.py; launched by test_distributed.launch as ``python mesh_worker.py SCENARIO OUT_DIR``).

Scenarios: ``mesh`` (4 ranks: pp=2 x dp_shard=2 over FSDP2, a user's loop with AdamW and clipping, the collectives of
a step, a DCP checkpoint, the stale-copy trap, bad input refused; interleaved and zbv over FSDP2; the checkpoint
loaded at pp=4), ``hsdp`` (8 ranks: dp_replicate=2 x dp_shard=2 x pp=2, the same loop), ``pp`` (2 ranks: the bytes a
rank holds after compile, for a model on the CPU and on meta, both routes; non-persistent buffers built on meta; a plan
broadcast from rank 0 as the cut; the DCP checkpoint of ``mesh`` loaded at pp=2, 2 more steps; a LlamaForCausalLM
built on meta loading a sharded safetensors checkpoint per stage, the peak bytes while loading, a checkpoint of other
names refused). Each rank writes ``rank<r>.pt``."""
import collections
import gc
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the root: zoo/
import autopipe  # noqa: E402
from zoo import GPT  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
CHUNKS, MAX_NORM, LR = 4, 0.05, 1e-2
NEW_LENGTHS = (12, 10)  # mesh_scenario's fourth step: each data-parallel rank's sequence length
HSDP_ROWS = 16  # hsdp_scenario's batch: 4 data-parallel pipelines of 4 rows, a row a micro-batch


def gpt64(**kw) -> GPT:
    """The tests' float64 GPT (tied LM head), the same weights on every rank."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        return GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0, **kw)
    finally:
        torch.set_default_dtype(torch.float32)


def batch(step: int, rows: int = 8):
    """Step ``step``'s whole batch: the plain model trains on all of it, data-parallel rank k on its k-th share."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (rows, 16), generator=g), torch.randint(0, 64, (rows, 16), generator=g)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(pipe, opt, steps, share: int, shares: int, counts: list | None = None, rows: int = 8):
    """The user's loop: step, clip, AdamW; each step's loss (None off the last stage) and total norm."""
    losses, norms = [], []
    for step in steps:
        ids, target = (t.chunk(shares)[share] for t in batch(step, rows))
        if counts is not None:
            counts.append(collections.Counter())
            COUNTED[0] = counts[-1]
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
        COUNTED[0] = None
        norms.append(pipe.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses, norms


COUNTED = [None]


def count_collectives() -> None:
    """Count the collectives FSDP2 issues (all-gather, reduce-scatter, all-reduce), while COUNTED[0] is set."""
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if COUNTED[0] is not None:
                COUNTED[0][_name] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)


def refused(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads which
        return f"{type(e).__name__}: {e}"
    return "not refused"


def mesh_scenario(rank: int, out: str) -> dict:
    """pp=2 x dp_shard=2: 3 steps of the user's loop, a DCP checkpoint, the traps, the refusals."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    results = {"refused": {}}
    bad = results["refused"]
    bad["no pp"] = refused(lambda: autopipe.compile(gpt64(), chunks=CHUNKS, mesh=init_device_mesh(
        "cpu", (4,), mesh_dim_names=("dp_shard",))))
    bad["balance"] = refused(lambda: autopipe.compile(gpt64(), chunks=CHUNKS, mesh=mesh, balance=[1, 1, 1]))
    from torch.distributed.fsdp import fully_shard
    user = gpt64()
    fully_shard(user.blocks[0], mesh=mesh["dp_shard"])
    bad["user fsdp"] = refused(lambda: autopipe.compile(user, chunks=CHUNKS, mesh=mesh))

    model = gpt64()
    ids, _ = batch(0)
    pipe = autopipe.compile(model, chunks=CHUNKS, mesh=mesh, schedule="1f1b", example_inputs=(ids.chunk(2)[0],))
    results["stage"], results["dp"] = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    results["local_elements"] = sum(p.to_local().numel() for p in pipe.parameters())
    results["full_elements"] = sum(p.numel() for p in pipe.parameters())
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    count_collectives()
    counts = []
    results["losses"], results["norms"] = train(pipe, opt, range(3), results["dp"], 2, counts)
    results["collectives"] = [dict(c) for c in counts]
    results["after3"] = {n: whole(p).detach().clone() for n, p in pipe.named_parameters()}
    results["grad_type"] = type(next(pipe.parameters())).__name__
    msd, osd = get_state_dict(pipe, opt, options=FLAT)
    results["model_keys"], results["optim_keys"] = sorted(msd), sorted(osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
    results["stale"] = stale_copy_trap(model, opt, os.path.join(out, "stale"))
    # dynamic padding per rank: a fourth step at new lengths, another on each data-parallel rank (NEW_LENGTHS)
    padded, target = (t.chunk(2)[results["dp"]][:, :NEW_LENGTHS[results["dp"]]] for t in batch(3))
    loss = pipe.step(padded, target=target, loss_fn=lm_loss)
    results["new_shape_norm"] = pipe.clip_grad_norm_(MAX_NORM).item()
    opt.step()
    opt.zero_grad()
    results["new_shape_loss"] = None if loss is None else loss.item()
    results["after_new_shape"] = {n: whole(p).detach().clone() for n, p in pipe.named_parameters()}
    bad["user fsdp on autopipe's"] = refused(lambda: fully_shard(pipe, mesh=mesh["dp_shard"]))  # torch's refusal
    pipe.close()
    for schedule, virtual_stages in (("interleaved", 2), ("zbv", 1)):  # two stages a rank, one FSDP2 group
        pipe = autopipe.compile(gpt64(), chunks=CHUNKS, mesh=mesh, schedule=schedule, virtual_stages=virtual_stages,
                                example_inputs=(ids.chunk(2)[0],))
        opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
        losses, norms = train(pipe, opt, range(3), results["dp"], 2)
        results[schedule] = {"losses": losses, "norms": norms, "stages": sorted(pipe.stage_indices),
                             "local_elements": sum(p.to_local().numel() for p in pipe.parameters()),
                             "full_elements": sum(p.numel() for p in pipe.parameters()),
                             "after3": {n: whole(p).detach().clone() for n, p in pipe.named_parameters()}}
        pipe.close()
    pipe = autopipe.compile(gpt64(), chunks=CHUNKS, schedule="1f1b", example_inputs=(ids,))  # pp=4, no FSDP2
    results["pp4"] = resumed(pipe, os.path.join(out, "ckpt"))
    plain = autopipe.compile(gpt64(), chunks=CHUNKS, example_inputs=(ids,))  # pp=4, no FSDP2 of autopipe's
    fully_shard(plain.stages[0], mesh=init_device_mesh("cpu", (4,)))
    bad["user fsdp on top"] = refused(lambda: plain.step(*batch(0), loss_fn=lm_loss))
    plain.close()
    return results


def stale_copy_trap(model, opt, path) -> str:
    """DCP's tutorial call on the model, not the pipeline: the other stages' tensors are on meta, so it raises."""
    try:
        msd, osd = get_state_dict(model, opt, options=FLAT)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"{type(e).__name__}: {str(e).splitlines()[-1][:300]}"
    return "saved"


def live_bytes() -> int:
    """The bytes of every tensor alive in this process with memory of its own (not meta, not fake, not a wrapper)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and not is_traceable_wrapper_subclass(o) \
                and o.device.type != "meta":
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def share_bytes(pipe) -> int:
    """The bytes of this rank's stages' own tensors."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*pipe.parameters(), *pipe.buffers())}
    return sum(storages.values())


def larger_gpt():
    torch.manual_seed(0)
    return GPT(vocab=256, d=64, heads=4, layers=4, block=16, dropout=0.0).double()


def on_meta(build):
    def built():
        with torch.device("meta"):
            return build()
    return built


class Rope(nn.Module):
    """A rotary table every block reads: a non-persistent buffer its constructor computes from what it keeps."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).double() / dim), persistent=False)


class Noisy(Rope):
    """Its buffer drawn at random: no rank can know the plain model's value."""

    def __init__(self, dim):
        super().__init__(dim)
        self.inv_freq.normal_()


class Forgetful(nn.Module):
    """Its constructor's argument not kept under its name: it cannot be built again."""

    def __init__(self, dim):
        super().__init__()
        self.d = dim
        self.register_buffer("inv_freq", torch.arange(0, dim, 2).double(), persistent=False)


class RotaryNet(nn.Module):
    def __init__(self, table=Rope):
        super().__init__()
        self.rope = table(16)
        self.blocks = nn.ModuleList(nn.Linear(8, 8).double() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x)) * self.rope.inv_freq
        return x


def resident_scenario(results: dict) -> None:
    """The bytes a rank holds after compile, over what it held before the model was built; its state-dict keys."""
    for name, build, route in (("cpu fx", larger_gpt, "fx"), ("meta fx", on_meta(larger_gpt), "fx"),
                               ("cpu export", larger_gpt, "export"), ("meta export", on_meta(larger_gpt), "export")):
        before = live_bytes()
        model = build()
        pipe = autopipe.compile(model, chunks=2, route=route, example_inputs=(torch.zeros(4, 16, dtype=torch.long),))
        results[name] = {"held": live_bytes() - before, "share": share_bytes(pipe), "keys": sorted(pipe.state_dict()),
                         "model_keys": sorted(model.state_dict()), "route": pipe.plan.route,
                         "devices": sorted({str(t.device) for t in (*pipe.parameters(), *pipe.buffers())}),
                         "on_meta": sum(t.is_meta for t in (*model.parameters(), *model.buffers()))}
        pipe.close()
        del pipe, model
    for table in (Rope, Noisy, Forgetful):
        with torch.device("meta"):
            model = RotaryNet(table)
        try:
            pipe = autopipe.compile(model, chunks=2, example_inputs=(torch.zeros(4, 8, dtype=torch.float64),))
        except ValueError as e:
            results[table.__name__] = f"ValueError: {e}"
            continue
        results[table.__name__] = {"inv_freq": dict(pipe.named_buffers())["rope.inv_freq"].clone(),
                                   "keys": sorted(pipe.state_dict())}
        pipe.close()


def resumed(pipe, checkpoint: str) -> dict:
    """The checkpoint mesh saved at pp=2 x dp_shard=2 (after 3 steps) loaded into ``pipe``, another layout without
    FSDP2: the loaded parameters, 2 more steps' losses and norms, the parameters after them."""
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    msd, osd = get_state_dict(pipe, opt, options=FLAT)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoint)
    set_state_dict(pipe, opt, model_state_dict=msd, optim_state_dict=osd, options=FLAT)
    results = {"loaded": {n: p.detach().clone() for n, p in pipe.named_parameters()}}
    results["resumed_losses"], results["resumed_norms"] = train(pipe, opt, range(3, 5), 0, 1)
    results["after5"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return results


def resume_scenario(results: dict, out: str) -> None:
    """The checkpoint mesh saved at pp=2 x dp_shard=2, loaded at pp=2 (no FSDP2): 2 more steps."""
    ids, _ = batch(0)
    pipe = autopipe.compile(gpt64(), chunks=CHUNKS, schedule="1f1b", example_inputs=(ids,))
    results.update(resumed(pipe, os.path.join(out, "ckpt")))


def pretrained_scenario(results: dict, out: str) -> None:
    """A LlamaForCausalLM built on meta loads the safetensors shards per stage; peak bytes while loading."""
    import transformers
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    config = transformers.AutoConfig.from_pretrained(os.path.join(out, "llama"))
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(3))
    pipe = autopipe.compile(model, chunks=2, example_kwargs={"input_ids": ids})
    results["llama_route"] = pipe.plan.route
    read, read_data = [], HuggingFaceStorageReader.read_data

    def recorded(self, plan, planner):
        read.extend(item.storage_index.fqn for item in plan.items)
        return read_data(self, plan, planner)
    HuggingFaceStorageReader.read_data = recorded
    results["bad_names"] = refused(lambda: pipe.load_pretrained(os.path.join(out, "renamed")))
    base, peak = anonymous_bytes(), [0]
    sampling = threading.Event()
    sampler = threading.Thread(target=sample, args=(peak, sampling))
    sampler.start()
    try:
        pipe.load_pretrained(os.path.join(out, "llama"))
    finally:
        sampling.set()
        sampler.join()
    HuggingFaceStorageReader.read_data = read_data
    results["load_peak"], results["read"] = max(peak[0] - base, 0), sorted(set(read))
    results["llama_state"] = {k: whole(v).detach().clone() for k, v in pipe.state_dict().items()}
    results["llama_buffers"] = {k: b.clone() for k, b in pipe.named_buffers()}
    loss = pipe.step(input_ids=ids, target=ids, loss_fn=lambda out, target: lm_loss(out.logits, target))
    results["llama_loss"] = None if loss is None else loss.item()
    pipe.close()


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (/proc/self/status RssAnon): what it allocated, not file pages."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def sample(peak: list, done: threading.Event) -> None:
    while not done.is_set():
        peak[0] = max(peak[0], anonymous_bytes())
        time.sleep(0.0005)


def hsdp_scenario(rank: int, out: str) -> dict:
    """HSDP on a pipeline: dp_replicate=2 x dp_shard=2 x pp (the world / 4), a user's loop of 3 steps with clipping,
    each of the 4 data-parallel pipelines on its quarter of a 16-row batch."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2, world // 4), mesh_dim_names=("dp_replicate", "dp_shard", "pp"))
    dp = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    ids, _ = batch(0, HSDP_ROWS)
    pipe = autopipe.compile(gpt64(), chunks=CHUNKS, mesh=mesh, schedule="1f1b", example_inputs=(ids.chunk(4)[dp],))
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    results = {"stage": mesh["pp"].get_local_rank(), "dp": dp,
               "local_elements": sum(p.to_local().numel() for p in pipe.parameters()),
               "full_elements": sum(p.numel() for p in pipe.parameters()),
               "placements": sorted({str(p.placements) for p in pipe.parameters()})}
    results["losses"], results["norms"] = train(pipe, opt, range(3), dp, 4, rows=HSDP_ROWS)
    results["after3"] = {n: whole(p).detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return results


def given_cut_scenario(results: dict) -> None:
    """docs/torchrun.md's measured cut: a plan made on rank 0 (here by shares, which any rank would cut alike),
    broadcast, and given to compile as ``balance=plan``."""
    ids, _ = batch(0)
    made = [autopipe.plan(gpt64(), (ids,), devices=2, chunks=CHUNKS, balance=[1, 3]) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    pipe = autopipe.compile(gpt64(), chunks=CHUNKS, balance=made[0], example_inputs=(ids,))
    results["given_cut"] = {"stages": [list(s.params) for s in pipe.plan.stages], "notes": list(pipe.plan.notes),
                            "made": [list(s.params) for s in made[0].stages],
                            "default": [list(s.params) for s in autopipe.plan(gpt64(), (ids,), devices=2).stages]}
    pipe.close()


def pp_scenario(rank: int, out: str) -> dict:
    results, saved = {}, os.environ.get("CHECKPOINTS", out)  # where mesh saved its checkpoint and the Llama's shards
    resident_scenario(results)
    given_cut_scenario(results)
    resume_scenario(results, saved)
    pretrained_scenario(results, saved)
    return results


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        results = {"mesh": mesh_scenario, "pp": pp_scenario, "hsdp": hsdp_scenario}[scenario](rank, out)
    except BaseException:
        traceback.print_exc()
        raise
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
