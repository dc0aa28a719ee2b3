"""The INT4 (W4A16) format's numbers, without torch.

`w4a16_format` describes the layout and packs tensors; these constants live apart so that code
which only sizes or validates INT4 weights (the converter's options, the operator rendering the
conversion Job) does not import torch.
"""

PACK = 8  # 4-bit codes per int32 word
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8  # the zero point of symmetric codes (signed value + 8)


def plane_ptx(i: int, mode: str) -> str:
    """PTX for nibble plane ``i`` of two int32 words ``$1``, ``$2`` -> bf16x2 ``$0`` (an
    ``inline_asm_elementwise`` with ``pack=2``).

    ``prmt`` puts the 16-bit half holding nibble ``i`` of ``$1`` in the low half and that of
    ``$2`` in the high half; one shift and one ``lop3`` (``(t & 0x000F000F) | 0x43004300``) give
    ``128 + code`` in both bf16 halves (bf16 ``0x4300`` is 128 and its last mantissa bit is 1), so
    two weights cost about two instructions. ``mode``:

    - ``"raw"``: ``128 + code``; the caller removes ``128 + zero`` itself;
    - ``"offset"``: ``$3`` holds bf16x2 ``-(128 + zero)``, and one ``fma`` gives ``code - zero``
      exactly;
    - ``"scaled"``: as ``"offset"``, then ``$4`` (the bf16x2 scale) and a second ``fma`` (with
      ``-0``) round ``(code - zero) * scale`` once, as an fp32 product cast to bf16 would.
    """
    t = "{ .reg .b32 t, c; "
    t += f"prmt.b32 t, $1, $2, {'0x5410' if i < 4 else '0x7632'}; "
    if i % 4:
        t += f"shr.u32 t, t, {4 * (i % 4)}; "
    if mode == "raw":
        return t + "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }"
    t += "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 c, 0x3F803F80; "
    if mode == "offset":
        return t + "fma.rn.bf16x2 $0, t, c, $3; }"
    assert mode == "scaled", mode
    t += "fma.rn.bf16x2 t, t, c, $3; "
    return t + "mov.b32 c, 0x80008000; fma.rn.bf16x2 $0, t, $4, c; }"
