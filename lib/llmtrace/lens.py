"""The logit lens: what the model would predict if it stopped after layer N.

Apply the final norm and the LM head (the model's own functions and weights) to the residual
stream after each layer, at one position. The last layer's lens is the model's real output.
"""

import torch
import torch.nn.functional as F

from .norm import rms_norm


@torch.inference_mode()
def logit_lens(model, trace, position: int = -1) -> torch.Tensor:
    """Probabilities [n_layers, V] at `position`, from `layers.N.resid_out` of a trace with values."""
    w, c = model.weights, model.config
    resid = torch.stack([trace[f"layers.{i}.resid_out"][0, position] for i in range(c.n_layers)])  # [L, D]
    logits = F.linear(rms_norm(resid, w.final_norm, c.norm_eps), w.lm_head)  # [L, V]
    return logits.softmax(-1)
