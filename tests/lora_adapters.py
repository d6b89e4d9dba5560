"""Random PEFT LoRA adapters and PEFT's own outputs with them: the
reference the LoRA tests compare cbserve against."""

from __future__ import annotations

import copy

import torch

from executor.lora import TARGETS


def make_adapter(base, path: str, targets=TARGETS, r: int = 8, alpha: float = 16, rslora: bool = False, seed: int = 0):
    """A random PEFT LoRA adapter of `base` saved at `path` (both A and B
    random, so the delta is not zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():  # B at the scale of A: a delta that moves the logits, not one that swamps them
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return path


def peft_reference(base, adapter: str | None, prompt: list[int], n: int):
    """PEFT's greedy tokens, their logprobs, and the prompt's logprobs."""
    model = copy.deepcopy(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    toks, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = model(torch.tensor([toks])).logits[0, -1].float().log_softmax(-1)
            t = int(lp.argmax())
            toks.append(t)
            lps.append(float(lp[t]))
        full = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    plp = [float(full[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    return toks[len(prompt) :], lps, plp
