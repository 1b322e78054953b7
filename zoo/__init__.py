"""The model zoo shared by the tests and the benchmarks (not part of the installed autopipe package).

- ``zoo.models``: our own models, small (the tests': ``build(name)``, ``random_inputs(name)``) and benchmark-sized
  (``transformer_like``, ``cnn_like``, and GPT-2/ResNet-50/U-Net/ViT-B sizes for the partition benchmark).
- ``zoo.thirdparty``: architectures people train (Llama, Qwen2, Mistral, GPT-2, BERT, T5, BART, ViT, ResNet,
  ConvNeXt, MobileNetV2/V3, diffusion UNets) from tiny transformers/diffusers configs, random weights; ``ZOO``
  names every factory. transformers and diffusers are imported only when a factory is called.

Import from the repository root (pytest's ``pythonpath``; the benchmarks and tests/runtime/dist_worker.py put the
root on ``sys.path`` themselves). The examples do not use it: each shows a user's own model, self-contained.
"""
from zoo.models import (GPT, MLP, UNet, DataclassModel, ExpertStack, KwargsModel, ResBlock, ResNet, ResNet50, RonnebergerUNet,
                        MaskedStack, ScaledByItem, SelfAttention, TransformerBlock, TransformerLike, TwoInputs, ViT, build, cnn_like, init_weights,
                        random_inputs, scalar_loss, tensor_leaves, transformer_like)
from zoo.thirdparty import ZOO, Example

__all__ = [
    "GPT", "MLP", "UNet", "DataclassModel", "ExpertStack", "KwargsModel", "MaskedStack", "ResBlock", "ResNet", "ResNet50", "RonnebergerUNet",
    "ScaledByItem", "SelfAttention", "TransformerBlock", "TransformerLike", "TwoInputs", "ViT", "build", "cnn_like", "init_weights",
    "random_inputs", "scalar_loss", "tensor_leaves", "transformer_like", "ZOO", "Example",
]
