"""Quantization: linear methods (FP8 / INT8 W8A8, W4A16 / W8A16), compressed-tensors
checkpoints, and `photon quantize`, which writes them.

Importing this package imports nothing else; photon.quant.config resolves `--quantization`.
"""
