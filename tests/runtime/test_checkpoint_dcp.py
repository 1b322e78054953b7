"""Checkpoints under torchrun (runtime/checkpoint.py): DCP's ``get_state_dict`` / ``set_state_dict`` with ``dcp.save``
/ ``dcp.load`` on the pipeline and its optimizer under the model's own names, a checkpoint saved at pp=2 x dp_shard=2
loaded at pp=2, at pp=4 and into the plain model in one process, training then going on exactly; the model itself cannot be
saved as a stale copy; a LlamaForCausalLM built on meta loads its sharded safetensors checkpoint per stage. The runs
are conftest.py's ``mesh_run`` (saves) and ``pp_run`` (loads)."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mesh_worker import FLAT, LR, MAX_NORM, batch, gpt64, lm_loss
from test_sharding import plain_training


def llama_checkpoint(directory) -> None:
    """A tiny LlamaForCausalLM (tied embedding and head) saved by ``save_pretrained`` in 6 safetensors shards, and
    the same tensors under one other name, for the refusal."""
    import transformers
    from safetensors.torch import save_file
    if (directory / "llama").exists():
        return
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=96, max_position_embeddings=32,
                                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory / "llama", max_shard_size="20KB")
    renamed = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    renamed["model.norm.scale"] = renamed.pop("model.norm.weight")
    (directory / "renamed").mkdir()
    save_file(renamed, directory / "renamed" / "model.safetensors")


def continued(model, opt, steps):
    norms = []
    for step in steps:
        ids, target = batch(step)
        lm_loss(model(ids), target).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return norms


def test_the_checkpoint_holds_the_models_names_flat(mesh_run):
    plain_keys = set(gpt64().state_dict())
    for r in mesh_run:
        assert set(r["model_keys"]) <= plain_keys
        assert all(k.startswith(("state.", "param_groups.")) for k in r["optim_keys"])
    assert set().union(*(r["model_keys"] for r in mesh_run)) == plain_keys


def assert_resumed_as_the_uninterrupted_run(ranks: list[dict]) -> None:
    """Each rank's parameters as loaded and after 2 more steps are the plain model's after 3 and 5 steps, every
    parameter on some rank; the norms and the last rank's losses are the plain model's."""
    params, losses, norms = plain_training(5)
    seen = set()
    for r in ranks:
        for name, p in r["loaded"].items():
            torch.testing.assert_close(p, params[2][name], rtol=0, atol=1e-10, msg=name)
        for name, p in r["after5"].items():
            torch.testing.assert_close(p, params[4][name], rtol=0, atol=1e-10, msg=name)
            seen.add(name)
        assert r["resumed_norms"] == pytest.approx(norms[3:], rel=1e-12)
    assert seen == set(params[4])
    assert ranks[-1]["resumed_losses"] == pytest.approx(losses[3:], rel=1e-12)


def test_a_checkpoint_saved_at_2x2_resumes_at_pp2_as_the_uninterrupted_run(pp_run):
    assert_resumed_as_the_uninterrupted_run(pp_run)


def test_a_checkpoint_saved_at_2x2_resumes_at_pp4_as_the_uninterrupted_run(mesh_run):
    """The same 4 ranks that saved it at pp=2 x dp_shard=2, as one pipeline of 4 stages without FSDP2."""
    assert_resumed_as_the_uninterrupted_run([r["pp4"] for r in mesh_run])


def test_a_checkpoint_saved_at_2x2_loads_into_the_plain_model_in_one_process(mesh_run, torchrun_dir):
    """No process group here: dcp.load reads the whole checkpoint; the tied embedding and head load as one."""
    params, _, norms = plain_training(5)
    model = gpt64()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.fspath(torchrun_dir / "ckpt"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=FLAT)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[2][name], rtol=0, atol=1e-10, msg=name)
    assert continued(model, opt, range(3, 5)) == pytest.approx(norms[3:], rel=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[4][name], rtol=0, atol=1e-10, msg=name)


def test_saving_the_model_rather_than_the_pipeline_raises(mesh_run):
    """DCP's tutorial call on the model: the other stages' tensors are on meta, so dcp.save fails on every rank
    rather than writing another rank's untrained copy."""
    for r in mesh_run:
        assert r["stale"].startswith("CheckpointException")


def test_a_llama_built_on_meta_loads_its_safetensors_shards_per_stage(pp_run, torchrun_dir):
    """Each rank reads only the tensors its stage holds (the tied head from the embedding's name), exactly the
    pretrained values; the rotary table its constructor's; the loss of a step the plain model's."""
    import transformers
    plain = transformers.LlamaForCausalLM.from_pretrained(torchrun_dir / "llama", dtype=torch.float64)
    state = plain.state_dict()
    for r in pp_run:
        assert r["llama_route"] == "export"
        for name, t in r["llama_state"].items():
            assert torch.equal(t, state[name]), name
        assert torch.equal(r["llama_buffers"]["model.rotary_emb.inv_freq"], plain.model.rotary_emb.inv_freq)
        read_as = {("model.embed_tokens.weight" if k == "lm_head.weight" else k) for k in r["llama_state"]}
        assert set(r["read"]) == read_as
    assert set(pp_run[0]["llama_state"]) | set(pp_run[1]["llama_state"]) == set(state)
    assert len(set(pp_run[0]["read"]) & set(pp_run[1]["read"])) == 1  # the tied embedding, held by both
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(3))
    want = lm_loss(plain(input_ids=ids).logits, ids).item()
    assert pp_run[0]["llama_loss"] is None and pp_run[1]["llama_loss"] == pytest.approx(want, rel=1e-12)


def test_a_checkpoint_of_other_names_is_refused_naming_the_first_missing_and_unexpected_key(pp_run):
    for r in pp_run:
        assert "first missing key 'model.norm.weight' (1 missing), first unexpected key 'model.norm.scale'" \
            in r["bad_names"]
