"""The model zoo (zoo/thirdparty.py) through autopipe.verify: one training step through the pipeline equals the
plain model's (float64, tolerance 1e-10) and re-materialisation replays the forward bit for bit.

A known failure goes in KNOWN (marked xfail(strict=False), with the error verify reported); none is open.
The models in SLOW (each also run elsewhere in every run, or too slow) run only with AUTOPIPE_SLOW_ZOO=1.
"""
from __future__ import annotations

import os

import pytest

import autopipe
from zoo import ZOO

NEEDS = {"unet_diffusers": "diffusers", "mobilenet_v3": None, "mobilenet_v3_train": None, "unet_timestep": None}

# Failures verify found at commit aa6f7b7, all fixed by 84c806a (they passed as XPASS, and their xfail marks are
# gone); a model that fails again shows verify's full report in the assertion message:
#   llama, qwen2, mistral: "structure raised RuntimeError: element 0 of tensors does not require grad and does not
#     have a grad_fn" -- tracing by torch.export left grad mode disabled in the calling thread.
#   t5: "replay: 49 over tolerance 0" -- outputs, loss and gradients of checkpoint='always' differed from 'never'
#     by ~3e-7 relative in float32: the no-grad forward of a re-materialised micro-batch was not bit-equal to its
#     recompute.
#   resnet_train: "structure: 12 over tolerance 1e-10 (resnet.embedder.embedder.normalization.running_mean, ...)"
#     -- re-materialisation updated the BatchNorm running statistics a second time (export route).
#   unet_diffusers: "structure raised TraceError: ... torch.export (non-strict, dim 0 of size 8 dynamic): UserError:
#     Constraints violated (batch)!" -- the model specialises on the batch size.
KNOWN: dict[str, str] = {}  # name -> reason: marked xfail(strict=False)

# Passes, but too slow for every run: set AUTOPIPE_SLOW_ZOO=1 to include it.
SLOW = {"mobilenet_v2": "~15 s: 17 inverted-residual blocks to trace three times, and float64 depthwise-convolution "
                        "backward has no fast CPU kernel",
        "unet_diffusers": "~26 s on 2 cores: it specialises on the batch size, so each micro-batch size is exported "
                          "again; test_faithfulness.py's batch-specialising UNet runs that class in every run",
        "t5": "~19 s: tests/test_huggingface_encoder_decoder.py runs T5 at K=2, 3 and 4 in every run",
        "bart": "~14 s: test_faithfulness.py's bit-for-bit recompute runs BART in every run"}

# run at 4 stages rather than 2: their train-mode twins (gpt2_train, mobilenet_v3_train) run at 2
DEVICES_4 = ["gpt2", "mobilenet_v3"]


def _case(name: str, devices: int):
    marks = [pytest.mark.xfail(strict=False, reason=KNOWN[name])] if name in KNOWN else []
    if name in SLOW and not os.environ.get("AUTOPIPE_SLOW_ZOO"):
        marks.append(pytest.mark.skip(reason=f"slow ({SLOW[name]}); AUTOPIPE_SLOW_ZOO=1 runs it"))
    return pytest.param(name, devices, marks=marks, id=f"{name}-{devices}")


CASES = [_case(name, 4 if name in DEVICES_4 else 2) for name in ZOO]


@pytest.mark.parametrize("name, devices", CASES)
def test_zoo_model_verifies(name, devices):
    needs = NEEDS.get(name, "transformers")
    if needs is not None:
        pytest.importorskip(needs)
    model, args, kwargs = ZOO[name]()
    report = autopipe.verify(model, args, kwargs, devices=devices, chunks=4)
    assert report.passed, f"\n{report}"
    assert report.devices == ["cpu"] * devices
    structure = report.structure[0]
    assert structure.tolerance == 1e-10 and structure.rows, "the structure part runs in float64"
    assert any(r.kind == "grad" for r in structure.rows)
    assert report.replay[0].tolerance == 0


def test_the_zoo_covers_the_architectures_people_train():
    assert len({name.removesuffix("_train") for name in ZOO}) >= 12
    for name in ("llama", "qwen2", "mistral", "gpt2", "bert", "t5", "bart", "vit", "resnet", "convnext",
                 "mobilenet_v2", "mobilenet_v3", "unet_timestep"):
        assert name in ZOO
    pytest.importorskip("transformers")
    for name in ("llama", "qwen2", "mistral"):  # grouped-query attention
        config = ZOO[name]()[0].config
        assert config.num_key_value_heads < config.num_attention_heads, name
