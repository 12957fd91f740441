"""The AO-GPT authors' state-dict names and ours, one to one (:func:`our_name`, :func:`their_name`).

Their model (scxue/AO-GPT-MDM's ``model_AOGPT_*.py``, ``model_sigmaGPT.py``) names tensors in
nanoGPT's style (``transformer.h.3.attn.c_attn.weight``); ours are the shared trunk's
(``blocks.3.attn.qkv.weight``). The tables below are facts about their naming; the mapping
is checked tensor by tensor where it is used (:func:`anyorder.interop.reference.map_state`).
"""

from __future__ import annotations

import re

# (theirs, ours) name prefixes, tried in turn on each key
_NAMES = [
    ("transformer.wte.weight", "tok_emb.weight"),
    ("transformer.wpe.weight", "pos_emb.weight"),
    ("transformer.wtpe.weight", "tgt_emb.weight"),
    ("transformer.wnonee.weight", "bos"),
    ("transformer.final_layer.ln_f.", "norm_f."),
    ("transformer.final_layer.adaLN_final.1.", "final_ada.linear."),
    ("transformer.ln_f.", "norm_f."),
    ("lm_head.", "head."),
]
_BLOCK = [
    ("ln_1.", "norm1."),
    ("ln_2.", "norm2."),
    ("attn.c_attn.", "attn.qkv."),
    ("attn.c_proj.", "attn.proj."),
    ("attn.q_norm.", "attn.q_norm."),
    ("attn.k_norm.", "attn.k_norm."),
    ("mlp.c_fc.", "mlp.fc."),
    ("mlp.c_proj.", "mlp.proj."),
    ("adaLN.1.", "ada.linear."),
]
_IN_BLOCK = re.compile(r"^transformer\.h\.(\d+)\.(.*)$")


def our_name(key: str) -> str | None:
    """Our state-dict name of a reference key (None: no counterpart)."""
    m = _IN_BLOCK.match(key)
    if m:
        for theirs, ours in _BLOCK:
            if m.group(2).startswith(theirs):
                return f"blocks.{m.group(1)}.{ours}{m.group(2)[len(theirs) :]}"
        return None
    for theirs, ours in _NAMES:
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    return None


def their_name(name: str, fmt: str) -> str:
    """The reference key of our state-dict ``name`` (the inverse of :func:`our_name`)."""
    skip = "transformer.ln_f." if fmt == "aogpt-ref" else "transformer.final_layer.ln_f."
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        for theirs, ours in _BLOCK:
            if rest.startswith(ours):
                return f"transformer.h.{i}.{theirs}{rest[len(ours) :]}"
    for theirs, ours in _NAMES:
        if theirs != skip and name.startswith(ours):
            return theirs + name[len(ours) :]
    return name
