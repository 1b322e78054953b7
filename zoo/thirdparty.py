"""Architectures people train, each from a tiny config with random weights (for autopipe.verify: tests/test_zoo.py).

Every factory takes no arguments and returns ``(model, example_args, example_kwargs)``, seeded, no downloads.
Configs are tiny (hidden 32, 2 layers, sequences of 16, images of 32x32, batch 8) so that one
``autopipe.verify`` runs in a few seconds on two cores. Hugging Face models come in ``eval()`` (dropout off;
BatchNorm on its running statistics) unless the name ends in ``_train``.

The MobileNetV3 is written out below in torchvision's own structure: in-place Hardswish/ReLU,
squeeze-and-excitation, and ``result += input`` on the residual.

Note [torchvision from PyPI]: torchvision from the registry is a CUDA build whose compiled ops fail to load
beside the CPU torch ("operator torchvision::nms does not exist"), and with it timm and diffusers models that
import it. The zoo uses transformers and models written here (MobileNetV3 written out).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, VOCAB, IMAGE = 8, 16, 64, 32

Example = tuple[nn.Module, tuple, dict[str, Any]]


def _transformers():
    import transformers
    return transformers


def _token_inputs(pad: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if pad:
        mask[1::2, SEQ - 5:] = 0  # right padding on every other row
    return {"input_ids": ids, "attention_mask": mask}


def _images(channels: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, channels, IMAGE, IMAGE, generator=torch.Generator().manual_seed(2))


# -- decoder LMs: RoPE, grouped-query attention -------------------------------------------------

def _decoder(config_cls, model_cls, **extra) -> Example:
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        use_cache=False, **extra)
    return model_cls(config).eval(), (), _token_inputs()


def llama() -> Example:
    """LlamaForCausalLM: RoPE, RMSNorm, SwiGLU, 4 query heads over 2 key/value heads."""
    t = _transformers()
    return _decoder(t.LlamaConfig, t.LlamaForCausalLM)


def qwen2() -> Example:
    """Qwen2ForCausalLM: RoPE, grouped-query attention, biases on q/k/v."""
    t = _transformers()
    return _decoder(t.Qwen2Config, t.Qwen2ForCausalLM)


def mistral() -> Example:
    """MistralForCausalLM: RoPE, grouped-query attention, sliding-window attention (window 8 < 16 tokens)."""
    t = _transformers()
    return _decoder(t.MistralConfig, t.MistralForCausalLM, sliding_window=8)


def gpt2() -> Example:
    """GPT2LMHeadModel: learned positions, tied LM head, labels: the model computes its own loss."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                          bos_token_id=0, eos_token_id=0, use_cache=False)
    inputs = _token_inputs()
    inputs["labels"] = inputs["input_ids"].clone()
    return t.GPT2LMHeadModel(config).eval(), (), inputs


def gpt2_train() -> Example:
    """GPT-2 in training mode: dropout on (embeddings, attention, residuals)."""
    model, args, kwargs = gpt2()
    return model.train(), args, kwargs


# -- encoders, encoder-decoders -----------------------------------------------------------------

def bert() -> Example:
    """BertForMaskedLM: encoder-only, padding mask, tied decoder, masked-LM labels (-100 elsewhere)."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64)
    inputs = _token_inputs()
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[:, 2:SEQ - 6:3] = inputs["input_ids"][:, 2:SEQ - 6:3]
    inputs["labels"] = labels
    return t.BertForMaskedLM(config).eval(), (), inputs


def t5() -> Example:
    """T5ForConditionalGeneration: relative position buckets, encoder-decoder with decoder_input_ids."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                        num_heads=4, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    inputs = _token_inputs()
    inputs["decoder_input_ids"] = torch.randint(1, VOCAB, (BATCH, 8), generator=torch.Generator().manual_seed(3))
    return t.T5ForConditionalGeneration(config).eval(), (), inputs


def bart() -> Example:
    """BartForConditionalGeneration: learned positions, encoder-decoder, shared embeddings."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    inputs = _token_inputs()
    inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, 8), generator=torch.Generator().manual_seed(3))
    return t.BartForConditionalGeneration(config).eval(), (), inputs


# -- vision ---------------------------------------------------------------------------------------

def vit() -> Example:
    """ViTForImageClassification: patch embedding, CLS token, learned positions."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=64, num_labels=10)
    return t.ViTForImageClassification(config).eval(), (), {"pixel_values": _images()}


def resnet() -> Example:
    """ResNetForImageClassification: convolutions with BatchNorm, residual shortcuts."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                            layer_type="basic", num_labels=10)
    return t.ResNetForImageClassification(config).eval(), (), {"pixel_values": _images()}


def resnet_train() -> Example:
    """ResNet in training mode: BatchNorm normalises each micro-batch and updates its running statistics."""
    model, args, kwargs = resnet()
    return model.train(), args, kwargs


def convnext() -> Example:
    """ConvNextForImageClassification: depthwise 7x7 convolutions, LayerNorm, layer scale."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                              num_labels=10)
    return t.ConvNextForImageClassification(config).eval(), (), {"pixel_values": _images()}


def mobilenet_v2() -> Example:
    """MobileNetV2ForImageClassification: inverted residuals, depthwise convolutions, BatchNorm, ReLU6."""
    t = _transformers()
    torch.manual_seed(0)
    config = t.MobileNetV2Config(num_channels=3, image_size=IMAGE, depth_multiplier=0.25, num_labels=10)
    return t.MobileNetV2ForImageClassification(config).eval(), (), {"pixel_values": _images()}


# -- MobileNetV3, as torchvision writes it ------------------------------------------------------------

def _make_divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class ConvBNActivation(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                 activation: Callable[..., nn.Module] | None = nn.ReLU):
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                                   nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        if activation is not None:
            layers.append(activation(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expanded: int, cout: int, kernel: int, stride: int, use_se: bool,
                 activation: Callable[..., nn.Module]):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(ConvBNActivation(cin, expanded, 1, activation=activation))
        layers.append(ConvBNActivation(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if use_se:
            layers.append(SqueezeExcitation(expanded, _make_divisible(expanded // 4)))
        layers.append(ConvBNActivation(expanded, cout, 1, activation=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x  # torchvision's own in-place residual
        return result


class MobileNetV3(nn.Module):
    """torchvision.models.mobilenet_v3_small's structure at a tiny width."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        RE, HS = nn.ReLU, nn.Hardswish
        settings = [  # cin, expanded, cout, kernel, stride, SE, activation
            (16, 16, 16, 3, 1, True, RE),
            (16, 32, 24, 3, 2, False, RE),
            (24, 48, 24, 3, 1, False, RE),
            (24, 64, 32, 5, 2, True, HS),
            (32, 96, 32, 5, 1, True, HS),
        ]
        layers: list[nn.Module] = [ConvBNActivation(3, 16, 3, 2, activation=HS)]
        layers += [InvertedResidual(*s) for s in settings]
        layers.append(ConvBNActivation(32, 96, 1, activation=HS))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(96, 64), nn.Hardswish(inplace=True), nn.Dropout(p=0.2, inplace=True),
                                        nn.Linear(64, num_classes))

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v3() -> Example:
    """A torchvision-style MobileNetV3 (in-place Hardswish/ReLU, SE, in-place residual), eval mode."""
    torch.manual_seed(0)
    return MobileNetV3().eval(), (_images(),), {}


def mobilenet_v3_train() -> Example:
    """The MobileNetV3 in training mode: BatchNorm per micro-batch, in-place dropout."""
    model, args, kwargs = mobilenet_v3()
    return model.train(), args, kwargs


# -- a diffusion UNet whose timestep broadcasts to the batch -------------------------------------------

def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimeResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(temb, cout)
        self.norm2 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class TimestepUNet(nn.Module):
    """A diffusers-style UNet: one timestep for the whole batch (a 0-dim tensor), broadcast to the batch
    with ``t.expand(x.shape[0])`` as UNet2DConditionModel does, so the graph mentions the batch size."""

    def __init__(self, c: int = 16, temb: int = 32):
        super().__init__()
        self.c = c
        self.time_mlp = nn.Sequential(nn.Linear(c, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inc = nn.Conv2d(3, c, 3, padding=1)
        self.down1 = TimeResBlock(c, c, temb)
        self.pool1 = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.down2 = TimeResBlock(c, 2 * c, temb)
        self.pool2 = nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1)
        self.mid = TimeResBlock(2 * c, 2 * c, temb)
        self.up2 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.dec2 = TimeResBlock(4 * c, c, temb)
        self.up1 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec1 = TimeResBlock(2 * c, c, temb)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x, t):
        if t.dim() == 0:  # as diffusers does: one timestep for the batch, as a 1-element tensor
            t = t[None]
        t = t.expand(x.shape[0])
        emb = self.time_mlp(timestep_embedding(t, self.c).to(x.dtype))
        h1 = self.down1(self.inc(x), emb)
        h2 = self.down2(self.pool1(h1), emb)
        h = self.mid(self.pool2(h2), emb)
        h = self.dec2(torch.cat([self.up2(h), h2], dim=1), emb)
        h = self.dec1(torch.cat([self.up1(h), h1], dim=1), emb)
        return self.out(F.silu(h))


def unet_timestep() -> Example:
    """TimestepUNet on 32x32 images with a 0-dim timestep."""
    torch.manual_seed(0)
    return TimestepUNet().eval(), (_images(), torch.tensor(17)), {}


def unet_diffusers() -> Example:
    """diffusers' UNet2DModel (ResNet blocks, attention down/up blocks, GroupNorm) with a 0-dim timestep,
    which it broadcasts to the batch (``timesteps * torch.ones(sample.shape[0])``)."""
    import diffusers
    diffusers.utils.logging.set_verbosity_error()  # its .to(float64) warns about float32 modules it has none of
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=IMAGE, in_channels=3, out_channels=3, block_out_channels=(16, 32),
                                  layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                                  attention_head_dim=8)
    return model.eval(), (_images(), torch.tensor(17)), {}


ZOO: dict[str, Callable[[], Example]] = {
    "llama": llama, "qwen2": qwen2, "mistral": mistral, "gpt2": gpt2, "gpt2_train": gpt2_train,
    "bert": bert, "t5": t5, "bart": bart,
    "vit": vit, "resnet": resnet, "resnet_train": resnet_train, "convnext": convnext, "mobilenet_v2": mobilenet_v2,
    "mobilenet_v3": mobilenet_v3, "mobilenet_v3_train": mobilenet_v3_train,
    "unet_timestep": unet_timestep, "unet_diffusers": unet_diffusers,
}
