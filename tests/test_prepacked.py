"""Prepacked weights on the CPU (``layers/linear.py``): the products F.linear gives, from
copies that are never stale, never made under a gradient, bounded by the memory available.

The decoding paths' own equality with the uncached oracle, with and without prepacked
weights, is drawn in ``tests/test_decode_oracle.py``; here the mechanism itself, against an
fp64 product computed independently.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import anyorder.layers.linear as lin
from anyorder import build_model, preset
from anyorder.layers.linear import Linear, prepacked, prepacked_for, use_prepacked
from anyorder.sample import sample

pytestmark = pytest.mark.skipif(not lin.available(), reason="this torch has no oneDNN kernels")


@pytest.fixture(autouse=True)
def _small_weights_too():
    """The layers here are small: copy them too (the default leaves out weights whose copy
    would not pay, :data:`anyorder.layers.linear.MIN_WEIGHT`), and read every copy made
    (the default reads those that won a race, :data:`~anyorder.layers.linear.RACE`); both
    tested at the end."""
    with lin.every_copy():  # the race is tested at the end
        yield


def _fp64(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    out = x.double() @ layer.weight.double().T
    return out if layer.bias is None else out + layer.bias.double()


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = preset("tiny", kind=kind, vocab_size=40, seq_len=32, n_layer=2, n_head=2, d_model=32)
    return build_model(cfg).eval()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lead=st.lists(st.integers(1, 3), max_size=2),
    rows=st.integers(1, 40),
    d_in=st.integers(1, 70),
    d_out=st.integers(1, 90),
    bias=st.booleans(),
    bf16=st.booleans(),
)
def test_a_prepacked_product_is_the_layers_product(lead, rows, d_in, d_out, bias, bf16) -> None:
    """Any shape, one or more leading dimensions, with or without bias, fp32 or bf16: the
    prepacked product equals the fp64 product to the dtype's round-off, from a copy laid out
    for one row or for several (where oneDNN takes the dtype)."""
    torch.manual_seed(rows * 1000 + d_in)
    dtype = torch.bfloat16 if bf16 else torch.float32
    layer = Linear(d_in, d_out, bias=bias).to(dtype)
    x = torch.randn(*lead, rows, d_in, dtype=dtype)
    packs = prepacked_for(layer)
    with torch.no_grad(), prepacked(packs):
        got = layer(x)
    assert got.shape == (*lead, rows, d_out) and got.dtype == dtype
    eps = 2.0**-8 if bf16 else 2.0**-23
    bound = float(x.abs().amax()) * float(layer.weight.detach().abs().amax()) * d_in
    tol = 4 * eps * (bound + 1)  # a dot product of d_in terms, rounded in dtype
    torch.testing.assert_close(got.double(), _fp64(x, layer), atol=tol, rtol=0)
    layout = lin.ONE_ROW if math.prod(lead) * rows == 1 else lin.MANY_ROWS
    assert [key[-1] for key in packs.entries] == ([] if packs.refused else [layout])


def test_a_weight_changed_in_place_is_repacked_never_stale() -> None:
    layer = Linear(24, 40)
    x = torch.randn(5, 24)
    packs = prepacked_for(layer)
    with torch.no_grad():
        with prepacked(packs):
            before = layer(x)
        layer.weight.mul_(-2.0)
        layer.bias.add_(1.0)
        with prepacked(packs):
            after = layer(x)
    torch.testing.assert_close(before, F.linear(x, layer.weight / -2.0, layer.bias - 1.0))
    torch.testing.assert_close(after, F.linear(x, layer.weight, layer.bias))
    assert len(packs.entries) == 1  # the stale copy was replaced, not kept beside


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_decoding_after_loading_other_weights_reads_the_new_weights(kind: str) -> None:
    """A model decoded once (copies made), then given another model's weights, in place
    (``load_state_dict``) and by replacing its tensors (``assign=True``): its next decode's
    logits are the other model's, and the copies of the weights it let go are dropped."""
    model, other = _model(kind, 0), _model(kind, 1)
    kw = dict(batch=3, top_k=1, keep_logits=True)
    sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
    first = dict(lin._packs[model].entries)
    assert first  # the decode made copies
    with use_prepacked(False):
        want = sample(other, 12, generator=torch.Generator().manual_seed(0), **kw)
    for assign in (False, True):
        model.load_state_dict(other.state_dict(), assign=assign)
        got = sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    packs = lin._packs[model]
    mine = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(w.untyped_storage().data_ptr() in mine for w, _, _ in packs.entries.values())
    assert packs.bytes == sum(w.numel() * w.element_size() for w, _, _ in packs.entries.values())


def test_decoding_packs_every_weight_of_the_model_and_nothing_made_in_the_forward() -> None:
    """An AO-GPT decode at batch 2: every linear weight of the blocks and the head is read
    from a copy; the adaLN join (a tensor the forward makes) is not copied."""
    model = _model("aogpt")
    out = sample(model, 10, batch=2, order="random", generator=torch.Generator().manual_seed(3))
    assert out.tokens.shape == (2, 10)
    packs = lin._packs[model]
    mine = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copied = {w.untyped_storage().data_ptr() for w, _, _ in packs.entries.values()}
    assert copied <= mine
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not name.endswith("ada.linear"):  # adaLN: joined
            assert m.weight.untyped_storage().data_ptr() in copied, name


def test_no_copy_under_a_gradient_and_the_gradient_is_f_linears() -> None:
    layer = Linear(16, 8)
    x = torch.randn(6, 16, requires_grad=True)
    packs = prepacked_for(layer)
    with prepacked(packs):
        layer(x).square().sum().backward()
    assert packs.entries == {}
    ref = Linear(16, 8)
    ref.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, ref.weight, ref.bias).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(x.grad, x2.grad)


def test_each_row_count_reads_its_layout_or_the_weight(monkeypatch) -> None:
    """One row reads a one-row copy or the weight itself, never a many-row copy (slower
    there than F.linear); several rows read a many-row copy, made where allowed, else a
    one-row one; nothing is made in a layout ``make`` leaves out."""
    read = []
    real = lin._product
    monkeypatch.setattr(lin, "_product", lambda x, c, b: read.append(c) or real(x, c, b))
    layer = Linear(16, 8)
    one, many = torch.randn(1, 16), torch.randn(5, 16)
    packs = prepacked_for(layer)

    def run(x, make):
        read.clear()
        with torch.no_grad(), prepacked(packs, make=make):
            got = layer(x)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
        return {key[-1]: copy for key, (_, _, copy) in packs.entries.items()}, list(read)

    copies, used = run(one, make=(lin.MANY_ROWS,))
    assert copies == {} and used == []
    copies, used = run(many, make=(lin.MANY_ROWS,))
    assert set(copies) == {lin.MANY_ROWS} and used == [copies[lin.MANY_ROWS]]
    copies, used = run(one, make=())
    assert used == []  # the many-row copy is not read for one row
    copies, used = run(one, make=(lin.ONE_ROW,))
    assert set(copies) == {lin.ONE_ROW, lin.MANY_ROWS} and used == [copies[lin.ONE_ROW]]
    del packs.entries[next(k for k in packs.entries if k[-1] == lin.MANY_ROWS)]
    packs.bytes -= layer.weight.numel() * 4
    copies, used = run(many, make=())
    assert set(copies) == {lin.ONE_ROW} and used == [copies[lin.ONE_ROW]]
    copies, used = run(many, make=(lin.MANY_ROWS,))  # may make its own: makes it
    assert set(copies) == {lin.ONE_ROW, lin.MANY_ROWS} and used == [copies[lin.MANY_ROWS]]


def test_copies_stop_at_half_the_available_memory(monkeypatch) -> None:
    layer = Linear(64, 64)  # 16 kB of weight
    x = torch.randn(4, 64)
    monkeypatch.setattr(lin, "available_memory", lambda: 2 * 16384 - 2)
    packs = prepacked_for(layer)
    with torch.no_grad(), prepacked(packs):
        got = layer(x)
    assert packs.entries == {} and packs.bytes == 0
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    monkeypatch.setattr(lin, "available_memory", lambda: 2 * 16384)
    packs = prepacked_for(layer)
    with torch.no_grad(), prepacked(packs):
        layer(x)
    assert packs.bytes == 16384


def test_a_layout_onednn_refuses_falls_back_once(monkeypatch) -> None:
    """Where oneDNN has no kernel for the dtype (bf16 on an AVX2 CPU), the product is
    F.linear's, and the refusal is remembered (not retried every pass)."""
    calls = []

    def refuse(weight, rows):
        calls.append(weight.shape)
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")

    monkeypatch.setattr(lin, "_reorder", refuse)
    layer = Linear(16, 8)
    x = torch.randn(3, 16)
    packs = prepacked_for(layer)
    with torch.no_grad(), prepacked(packs):
        a, b = layer(x), layer(x)
    assert len(calls) == 1 and len(packs.refused) == 1 and packs.entries == {}
    torch.testing.assert_close(a, F.linear(x, layer.weight, layer.bias))
    assert torch.equal(a, b)


def test_turned_off_by_the_context_and_by_the_environment() -> None:
    layer = Linear(16, 8)
    with use_prepacked(False):
        assert prepacked_for(layer) is None
    assert prepacked_for(layer) is not None
    code = (
        "import torch, anyorder.layers.linear as m; print(m.prepacked_for(torch.nn.Linear(2, 1)))"
    )
    code += "; print(m.prepacked_for(torch.nn.Linear(2, 1)) is not None)"
    for value, on in (("0", False), ("False", False), (" off ", False), ("no", False), ("1", True)):
        env = dict(os.environ, ANYORDER_PREPACK=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        first, second = out.stdout.strip().splitlines()
        assert (first == "None", second) == (not on, str(on)), (value, out.stdout)


def test_a_threads_prepacking_is_its_own() -> None:
    """What one thread's ``prepacked()`` or ``use_prepacked()`` says holds in that thread:
    another, meanwhile, multiplies by the weight itself (bit for bit F.linear's) and turns
    nothing on or off for it; two threads entering and leaving out of order leave neither
    with a copy to read afterwards. Decodes of one model in several threads share its
    copies, made once."""
    layer = Linear(48, 40)
    x = torch.randn(5, 48)
    packs = prepacked_for(layer)
    inside, done = threading.Event(), threading.Event()
    got: dict[str, object] = {}

    def decoding() -> None:  # a decode in another thread, open while this one works
        with torch.no_grad(), prepacked(packs):
            got["copy"] = layer(x)
            inside.set()
            assert done.wait(30)
            with use_prepacked(False):
                got["off there"] = prepacked_for(layer) is None
            got["copy again"] = layer(x)

    thread = threading.Thread(target=decoding)
    thread.start()
    assert inside.wait(30)
    with torch.no_grad():
        here = layer(x)
    assert torch.equal(here, F.linear(x, layer.weight, layer.bias))
    assert prepacked_for(layer) is packs  # on here, whatever the other thread turns off
    done.set()
    thread.join(30)
    assert got["off there"] is True
    assert set(packs.entries) == {(layer.weight.data_ptr(), (40, 48), torch.float32, 16)}
    torch.testing.assert_close(got["copy"], _fp64(x, layer).float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(got["copy"], got["copy again"])
    assert lin._here.packs is None

    outs: list[torch.Tensor] = []

    def decode() -> None:
        with torch.no_grad(), prepacked(prepacked_for(layer)):
            outs.extend(layer(x) for _ in range(50))

    threads = [threading.Thread(target=decode) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outs) == 200
    for o in outs:  # each thread's product may split its work differently: round-off apart
        torch.testing.assert_close(o, got["copy"], atol=1e-6, rtol=1e-6)
    assert len(packs.entries) == 1 and packs.bytes == 40 * 48 * 4


def test_not_on_other_devices_or_a_meta_model() -> None:
    layer = Linear(4, 4, device="meta")
    assert prepacked_for(layer) is None


def test_a_prefill_makes_no_copies_and_one_row_passes_none() -> None:
    """Left to right at batch 1 after a 6-token prompt: the prefill (7 rows, once) and the
    one-row passes read the weights themselves; at batch 2 the passes make the copies and a
    later batch-1 prefill reads them."""
    model = _model("gpt")
    prompt = torch.randint(0, 40, (1, 16), generator=torch.Generator().manual_seed(0))
    known = torch.zeros(1, 16, dtype=torch.bool)
    known[:, :6] = True
    kw = dict(prompt=prompt, known=known, top_k=1, keep_logits=True)
    with use_prepacked(False):
        want = sample(model, 16, **kw)
    got = sample(model, 16, **kw)
    assert lin._packs[model].entries == {}
    assert torch.equal(got.tokens, want.tokens)
    sample(model, 16, batch=2, **kw)
    assert lin._packs[model].entries
    again = sample(model, 16, **kw)
    assert torch.equal(again.tokens, want.tokens)
    torch.testing.assert_close(again.logits, want.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["gpt", "armd"])
def test_under_bf16_autocast_decoding_is_the_plain_decode(kind: str) -> None:
    """Autocast casts ``F.linear``'s operands; a copy would keep fp32 (and the cache, made in
    the autocast dtype, would refuse it): under autocast the weights are read as they are."""
    model = _model(kind)
    kw = dict(batch=3, top_k=1, keep_logits=True)
    outs = []
    for on in (True, False):
        with use_prepacked(on), torch.autocast("cpu", torch.bfloat16):
            outs.append(sample(model, 12, generator=torch.Generator().manual_seed(0), **kw))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert lin._packs[model].entries == {}


def test_small_weights_are_read_as_they_are(monkeypatch) -> None:
    monkeypatch.setattr(lin, "MIN_WEIGHT", 1 << 18)
    small, big = Linear(512, 512), Linear(512, 513)  # 2**18 elements and one row more
    x = torch.randn(4, 512)
    for layer, copied in ((small, False), (big, True)):
        packs = prepacked_for(layer)
        with torch.no_grad(), prepacked(packs):
            got = layer(x)
        assert bool(packs.entries) == copied
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))


def test_one_row_copies_come_once_the_model_has_decoded_enough_one_row_passes() -> None:
    """Batch-1 left-to-right decodes of 12 one-row passes each: no copies for the first five
    (60 passes), one-row copies in the sixth (72 >= 64), and the same tokens and logits
    throughout as without prepacking."""
    model = _model("gpt")
    kw = dict(top_k=1, keep_logits=True)
    with use_prepacked(False):
        want = sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
    for i in range(6):
        got = sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        packs = lin._packs[model]
        assert packs.one_row_passes == 12 * (i + 1)
        assert {key[-1] for key in packs.entries} == (set() if i < 5 else {lin.ONE_ROW}), i


@pytest.mark.parametrize("copy_wins", [True, False])
def test_a_copy_is_read_only_where_it_won_its_race(monkeypatch, copy_wins: bool) -> None:
    """The first product of each shape and row count times both ways: a slower copy is
    never read again (F.linear's output from then on), a faster one always; the verdict
    holds per row count (in powers of two), and the output is right either way."""
    monkeypatch.setattr(lin, "RACE", True)
    monkeypatch.setattr(lin, "_faster", {})
    read = []
    real_product, real_plain = lin._product, lin._plain

    def product(x, copy, bias):
        read.append(x.shape[0])
        if not copy_wins:
            time.sleep(0.02)
        return real_product(x, copy, bias)

    def plain(x, weight, bias):
        if copy_wins:
            time.sleep(0.02)
        return real_plain(x, weight, bias)

    monkeypatch.setattr(lin, "_product", product)
    monkeypatch.setattr(lin, "_plain", plain)
    layer = Linear(16, 8)
    packs = prepacked_for(layer)
    for rows in (3, 4, 3, 5, 4):
        x = torch.randn(rows, 16)
        with torch.no_grad(), prepacked(packs):
            got = layer(x)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    # rows 3 and 4 share a race (up to 4), 5 has its own (up to 8): 3 products each
    races = [3, 3, 3, 5, 5, 5]
    assert read == (races[:3] + [4, 3] + races[3:] + [4] if copy_wins else races)
    assert set(lin._faster.values()) == {copy_wins} and len(lin._faster) == 2


def _loss_step(optimizer) -> None:
    """One optimizer step on a loss whose gradient is a fixed random direction for every
    parameter: every weight moves, as in training (what moves them is the optimizer's own
    update)."""
    g = torch.Generator().manual_seed(7)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad()
    sum((p * torch.randn(p.shape, generator=g)).sum() for p in params).backward()
    optimizer.step()


def _weights(model):
    return [p for name, p in model.named_parameters() if p.dim() == 2]


def _optimizer(name: str):
    def step(model) -> None:
        params = list(model.parameters())
        make = {
            "fused AdamW": lambda: torch.optim.AdamW(params, lr=1e-2, fused=True),
            "fused SGD": lambda: torch.optim.SGD(params, lr=0.1, fused=True),
            "Adam": lambda: torch.optim.Adam(params, lr=1e-2, foreach=False),
            "SGD": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        }[name]
        opt = make()
        for _ in range(2):
            _loss_step(opt)

    return step


def _through_data(how: str):
    def change(model) -> None:
        g = torch.Generator().manual_seed(8)
        for p in _weights(model):
            if how == "rows":  # a row permutation, in place, unseen by the version counter
                p.data.copy_(p.data.flip(0))
            elif how == "columns":  # columns moved by one 64-bit word: rows' sums unchanged
                p.data.copy_(p.data.roll(2, dims=1))
            elif how == "add":
                p.data += 0.05 * torch.randn(p.shape, generator=g)
            else:  # "assign": a new tensor in place of the old
                p.data = 1.5 * p.data

    return change


def _load_other(model) -> None:
    model.load_state_dict(_model(model.cfg.kind, 1).state_dict())


def _lora_merge(model) -> None:
    """peft's LoRA on the attention, its B matrices set (an adapter trained elsewhere), then
    merged into the weights in place (peft adds to ``weight.data``)."""
    from anyorder.config.run import LoraConfig
    from anyorder.models.lora import add_adapters, merge_adapters

    tuner = add_adapters(model, LoraConfig(r=4, targets=("attn",)))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    assert merge_adapters(tuner) is model


CHANGES = {
    "fused AdamW": _optimizer("fused AdamW"),
    "fused SGD": _optimizer("fused SGD"),
    "Adam": _optimizer("Adam"),
    "SGD": _optimizer("SGD"),
    "data rows": _through_data("rows"),
    "data columns": _through_data("columns"),
    "data add": _through_data("add"),
    "data assign": _through_data("assign"),
    "load_state_dict": _load_other,
    "LoRA merge": _lora_merge,
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd", "mdm"])
def test_a_decode_after_the_weights_change_reads_the_current_weights(kind, change) -> None:
    """A model decoded once (copies made), then its weights changed: by optimizer steps
    (fused ones leave the version counter as it was), through ``.data`` (permuted rows or
    columns, added to, replaced), by ``load_state_dict`` or a LoRA merge. Its next decode
    equals, in tokens and logits, that of a fresh model given the current weights and
    decoded without prepacked weights, and reads copies (made again)."""
    model = _model(kind)
    kw = dict(batch=3, top_k=1, keep_logits=True)
    sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
    assert lin._packs[model].entries  # the decode made copies
    CHANGES[change](model)
    model.eval()
    got = sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
    fresh = _model(kind, 2)
    fresh.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    with use_prepacked(False):
        want = sample(fresh, 12, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert lin._packs[model].entries


def _product_now(layer, x, packs):
    with torch.no_grad(), prepacked(packs):
        return layer(x)


@pytest.mark.parametrize(
    "write",
    [
        "swap two values of a row",
        "swap two rows",
        "negate",
        "numpy",
        "untyped storage",
        "odd width",
        "edits a plain sum cancels",
    ],
)
def test_every_write_to_a_weight_is_seen_at_the_next_decode(write: str) -> None:
    """Writes the version counter does not see, each the smallest of its kind (two values
    swapped within one row leave the row's sum as it was; a sign flip of every value; bytes
    written through numpy or the storage; a weight whose rows are no whole 64-bit words):
    the next decode (``prepacked_for``) multiplies by the weight as it is now."""
    layer = Linear(23 if write == "odd width" else 24, 40)
    x = torch.randn(5, layer.in_features)
    _product_now(layer, x, prepacked_for(layer))
    w = layer.weight
    version = w._version
    if write == "swap two values of a row":
        w.data[3, [4, 6]] = w.data[3, [6, 4]]
    elif write == "swap two rows":
        w.data[[1, 7]] = w.data[[7, 1]]
    elif write == "negate":
        w.data.neg_()
    elif write == "numpy":
        w.detach().numpy()[10, 0] += 1.0
    elif write == "untyped storage":
        w.untyped_storage().copy_(torch.randn(w.numel()).untyped_storage())
    elif write == "edits a plain sum cancels":  # every row's and column's word sum unchanged
        words = w.detach().numpy().view(np.int64)  # (40, 12): two fp32 values a word
        k = 1 << 20  # about 12% of a value's mantissa: the product moves far past tolerance
        words[2, 1] += k
        words[2, 3] -= k
        words[5, 1] -= k
        words[5, 3] += k
    else:
        w.data[0, 22] = 7.0
    assert w._version == version  # unseen by the counter
    packs = prepacked_for(layer)
    got = _product_now(layer, x, packs)
    torch.testing.assert_close(got, F.linear(x, w, layer.bias), atol=1e-5, rtol=1e-5)
    assert len(packs.entries) == 1  # the stale copy was dropped and the new one made


def test_unchanged_weights_keep_their_copies_across_decodes() -> None:
    """Nothing written: the copies made by the first decode are the ones later decodes read
    (checked, not made again)."""
    model = _model("armd")
    kw = dict(batch=3, top_k=1)
    sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
    first = {k: copy for k, (_, _, copy) in lin._packs[model].entries.items()}
    sample(model, 12, generator=torch.Generator().manual_seed(1), **kw)
    again = {k: copy for k, (_, _, copy) in lin._packs[model].entries.items()}
    assert first.keys() == again.keys() and all(again[k] is first[k] for k in first)


def test_a_decode_too_short_to_pay_for_the_check_reads_the_weights(monkeypatch) -> None:
    """With the default thresholds (:data:`~anyorder.layers.linear.READ_PASSES`): a batch-1
    decode of 12 one-row passes and an mdm decode of 4 passes read no copy (nor check one),
    a batch-3 decode of 12 passes reads them; every decode equals the plain one."""
    monkeypatch.setattr(lin, "READ_PASSES", (8, 32))
    read = []
    real = lin._product
    monkeypatch.setattr(lin, "_product", lambda x, c, b: read.append(1) or real(x, c, b))
    for kind, kw, reads in (
        ("gpt", dict(batch=3), True),
        ("gpt", dict(batch=1), False),
        ("mdm", dict(batch=3, steps=4), False),
    ):
        model = _model(kind)
        sample(model, 12, batch=3, generator=torch.Generator().manual_seed(1))  # copies made
        assert lin._packs[model].entries
        read.clear()
        kw.update(top_k=1, keep_logits=True)
        got = sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
        with use_prepacked(False):
            want = sample(model, 12, generator=torch.Generator().manual_seed(0), **kw)
        assert bool(read) == reads, (kind, kw)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
