"""Gradient compression for allreduce: ``Compression.none`` and ``Compression.fp16`` (Horovod's API)."""

from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Interface: ``compress`` returns (tensor, context); ``decompress(tensor, context)`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes); other dtypes unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        compressed = tensor.type(torch.float16) if tensor.dtype.is_floating_point else tensor
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx.is_floating_point else tensor


class Compression:
    """Optional gradient compression used during allreduce."""

    none = NoneCompressor
    """No compression (the default)."""
    fp16 = FP16Compressor
    """Floating-point gradients travel as float16: half the bytes per allreduce."""
