"""lp-lightning: MXFP8 and HiF8 online low-precision pretraining of DeepSeek-V3 on FSDP2.

Importing this package never imports ``torch_npu``; only selecting the ``npu`` op backend does.
"""

__version__ = "0.1.0"
