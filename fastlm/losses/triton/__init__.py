"""Fused Triton kernel of the monolithic loss (CE, z-loss, GRPO, GSPO, distillation) and its launcher.

Importing this package imports triton: set TRITON_INTERPRET=1 before it to run on CPU.
"""

from fastlm.losses.triton.launcher import MAX_BLOCK, triton_loss

__all__ = ["MAX_BLOCK", "triton_loss"]
