"""Fused Triton kernel of the label-based monolithic loss (CE, z-loss, GRPO, GSPO) and its launcher.

Importing this package imports triton: set TRITON_INTERPRET=1 before it to run on CPU.
"""

from fastlm.losses.triton.launcher import MAX_BLOCK, triton_loss

__all__ = ["MAX_BLOCK", "triton_loss"]
