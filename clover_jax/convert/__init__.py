"""Conversion between native checkpoints and HuggingFace safetensors, streaming and atomic.

`pipeline` runs a conversion; `hf_io` reads and writes safetensors; `mapping` describes how HF
tensors map onto native weights; one module per HF family (`clover`, `llada2_moe`, `llada_moe`,
`qwen3_moe`) says its config fields and tensor names; `quantize` quantizes weights as they stream through
(`--quantize`) and reads quantized ones back as float (`--dequantize`).
"""

from clover_jax.convert.pipeline import FAMILIES, convert, hf_to_native, is_native, native_to_hf, quantize_native
from clover_jax.errors import ConversionError

__all__ = ["FAMILIES", "ConversionError", "convert", "hf_to_native", "is_native", "native_to_hf", "quantize_native"]
