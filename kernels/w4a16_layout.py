"""The INT4 (W4A16) format's numbers, without torch.

`w4a16_format` describes the layout and packs tensors; these constants live apart so that code
which only sizes or validates INT4 weights (the converter's options, the operator rendering the
conversion Job) does not import torch.
"""

PACK = 8  # 4-bit codes per int32 word
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8  # the zero point of symmetric codes (signed value + 8)
