"""Transport core: encrypted ordered frames, compact tensor payloads, an emulated WAN link.

Plain Python (no Flower imports). See :mod:`.crypto` for the frame layout, :mod:`.quant` for
the payload format and :mod:`.wan` for the delay model.
"""

from .crypto import (
    FRAME_OVERHEAD,
    FRAME_VERSION,
    HEADER_BYTES,
    TAG_BYTES,
    FrameError,
    HandshakeError,
    KeyPair,
    ReorderError,
    ReplayError,
    SecureSession,
    TamperedFrameError,
    TruncatedFrameError,
    derive_session,
    generate_keypair,
    new_session_id,
)
from .quant import (
    PayloadError,
    QuantizedTensor,
    SparseTensor,
    decode,
    densify,
    dequantize,
    encode,
    payload_nbytes,
    quantize_int8_rows,
    topk_sparse,
)
from .wan import PRESETS, WanLink, WanProfile

__all__ = [
    "FRAME_OVERHEAD",
    "FRAME_VERSION",
    "HEADER_BYTES",
    "TAG_BYTES",
    "FrameError",
    "HandshakeError",
    "KeyPair",
    "ReorderError",
    "ReplayError",
    "SecureSession",
    "TamperedFrameError",
    "TruncatedFrameError",
    "derive_session",
    "generate_keypair",
    "new_session_id",
    "PayloadError",
    "QuantizedTensor",
    "SparseTensor",
    "decode",
    "densify",
    "dequantize",
    "encode",
    "payload_nbytes",
    "quantize_int8_rows",
    "topk_sparse",
    "PRESETS",
    "WanLink",
    "WanProfile",
]
