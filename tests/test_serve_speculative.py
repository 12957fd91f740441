"""``anyorder serve`` with speculative decoding: the ``round`` events are the sampler's
``on_round`` hook and rebuild its result and its statistics exactly, the new field is
checked strictly (also against hostile bodies), and the page shows drafts, accepted drafts
and replaced ones in a real headless Chromium."""

from __future__ import annotations

import json

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import SamplingError
from anyorder.interop.hub import load_any
from anyorder.sample import decode_text, parse_template, speculative_sample
from anyorder.serve import Limits, parse_request
from test_serve import CHROMIUM, CHROMIUM_ARGS, TEMPLATE, Running, _playwright, parse_sse
from test_serve_attacks import ask, error_of, info_within_a_second, post

from conftest import tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny real models with the byte tokenizer, saved: kind -> (folder, loaded). Their
    weights are moved off the init: at the init every conditional is nearly uniform, drafts
    and targets agree, and a rejection is rare, so the replaced tokens would go untested."""
    root = tmp_path_factory.mktemp("serve-spec")
    out = {}
    gen = torch.Generator().manual_seed(0)
    for kind in ("aogpt", "armd", "gpt", "mdm"):
        model = tiny_model(kind, seed=3, vocab_size=257, seq_len=32)
        with torch.no_grad():
            for w in model.parameters():
                w.add_(0.3 * torch.randn(w.shape, generator=gen))
        folder = save_pretrained(model, root / kind, ByteTokenizer())
        out[kind] = (folder, load_any(folder))
    return out


def direct(loaded, body: dict):
    """The request drawn by calling :func:`speculative_sample` directly: the result, its
    ``on_round`` dicts as lists, and the texts."""
    tok, model = loaded.tokenizer, loaded.model
    prompt = known = None
    if "[MASK" in body["text"]:
        prompt, known = parse_template(body["text"], tok, model.cfg.seq_len)
        n = len(prompt)
    else:
        n = body["length"]
        ids = tok.encode(body["text"])
        prompt = torch.tensor(ids + [0] * (n - len(ids)))
        known = torch.arange(n) < len(ids)
    rounds: list = []
    result = speculative_sample(
        model, n, body["speculative"], batch=body.get("num_samples", 1),
        order=body.get("mode", "random"), prompt=prompt, known=known,
        temperature=body.get("temperature", 1.0), top_p=body.get("top_p"),
        generator=torch.Generator(model.device).manual_seed(body["seed"]),
        on_round=lambda r: rounds.append({k: v.tolist() for k, v in r.items()}),
    )  # fmt: skip
    eos = None if "[MASK" in body["text"] else tok.eos_id
    return result, rounds, [decode_text(tok, row, eos) for row in result.tokens.cpu()]


CASES = [
    ("armd", {"text": TEMPLATE, "speculative": 3, "seed": 2, "num_samples": 2}),
    (
        "armd",
        {
            "text": "def ",
            "mode": "l2r",
            "length": 24,
            "speculative": 4,
            "seed": 5,
            "temperature": 0.7,
            "top_p": 0.9,
        },
    ),  # fmt: skip
    ("aogpt", {"text": TEMPLATE, "speculative": 2, "seed": 7, "num_samples": 3}),
    ("aogpt", {"text": "ab", "length": 20, "speculative": 5, "seed": 1, "temperature": 0.8}),
]


@pytest.mark.parametrize("kind, body", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_round_events_rebuild_the_sample_and_its_counts(models, kind: str, body: dict) -> None:
    loaded = models[kind][1]
    server = Running(loaded)
    try:
        status, text = server.post(body)
    finally:
        server.close()
    assert status == 200, text
    events = parse_sse(text)
    names = [e for e, _ in events]
    # start, then a round before each step, then done
    assert names[0] == "start" and names[-1] == "done"
    assert names[1:-1] == ["round", "step"] * ((len(names) - 2) // 2)
    start, done = events[0][1], events[-1][1]
    pairs = [(events[i][1], events[i + 1][1]) for i in range(1, len(events) - 1, 2)]
    result, hook_rounds, texts = direct(loaded, body)
    tokens, step_of = result.tokens.cpu(), result.step_of.cpu()
    stats = result.extra["speculative"]
    B, n = tokens.shape
    assert start["speculative"] == body["speculative"] and start["n"] == n
    assert len(pairs) == len(hook_rounds) == result.forward_passes
    # each round is the hook's dict (padding dropped) ...
    for (rnd, step), hook in zip(pairs, hook_rounds):
        assert rnd["pass"] == step["pass"] and rnd["step"] == step["step"]
        for i, row in enumerate(rnd["rows"]):
            want = [[p, t] for p, t in zip(hook["positions"][i], hook["tokens"][i]) if p < n]
            assert [d[:2] for d in row["drafts"]] == want
            if hook["position"][i] == n:  # finished before this pass
                assert row == {"drafts": [], "accepted": 0, "closing": None, "replaced": False}
                continue
            assert row["accepted"] == hook["accepted"][i]
            assert row["closing"][:2] == [hook["position"][i], hook["token"][i]]
    # ... and its accepted drafts and closing token are exactly the step's decided cells
    rebuilt = torch.full((B, n), -9)
    rebuilt_step = torch.full((B, n), -2)
    for p, t, _ in start["prompt"]:
        rebuilt[:, p], rebuilt_step[:, p] = t, -1
    sums = {k: [0] * B for k in ("passes", "drafted", "accepted", "tokens")}
    for rnd, step in pairs:
        for i, row in enumerate(rnd["rows"]):
            closing = [row["closing"]] if row["closing"] else []
            decided = row["drafts"][: row["accepted"]] + closing
            assert [c[:2] for c in decided] == [c[:2] for c in step["rows"][i]]
            if row["replaced"]:  # the residual (q - p)+ is 0 at the rejected draft
                rejected = row["drafts"][row["accepted"]]
                assert rejected[0] == row["closing"][0] and rejected[1] != row["closing"][1]
            else:
                assert row["accepted"] == len(row["drafts"])
            for p, t, _ in decided:
                assert rebuilt_step[i, p] == -2, "a position was decided twice"
                rebuilt[i, p], rebuilt_step[i, p] = t, step["step"]
            sums["passes"][i] += row["closing"] is not None
            sums["drafted"][i] += len(row["drafts"])
            sums["accepted"][i] += row["accepted"]
            sums["tokens"][i] += len(decided)
        # running totals: everything so far, summed over the samples
        assert [rnd[k] for k in sums] == [sum(v) for v in sums.values()]
    torch.testing.assert_close(rebuilt, tokens, rtol=0, atol=0)
    torch.testing.assert_close(rebuilt_step, step_of, rtol=0, atol=0)
    # the statistics: the sampler's, the events', and tokens = accepted + one per pass
    want = {k: getattr(stats, k).tolist() for k in sums}
    assert done["speculative"] == want == sums
    generated = [int(g) for g in (step_of >= 0).sum(1)]
    assert sums["tokens"] == generated
    assert [a + p for a, p in zip(sums["accepted"], sums["passes"])] == generated
    assert all(p <= t for p, t in zip(sums["passes"], sums["tokens"]))
    assert done["tokens"] == tokens.tolist() and done["texts"] == texts
    assert done["forward_passes"] == result.forward_passes
    replaced = sum(row["replaced"] for rnd, _ in pairs for row in rnd["rows"])
    assert replaced >= 1 and sum(sums["accepted"]) >= 1  # both branches are exercised
    if B > 1:  # samples finish at different passes: a finished one's rounds are empty
        assert any(row["closing"] is None for rnd, _ in pairs for row in rnd["rows"])


def test_one_token_per_pass_has_no_drafts(models) -> None:
    """K = 1 is the sequential sampler: every round has no drafts and closes with a draw."""
    body = {"text": "ab", "mode": "l2r", "length": 10, "speculative": 1, "seed": 3}
    server = Running(models["aogpt"][1])
    try:
        status, text = server.post(body)
    finally:
        server.close()
    events = parse_sse(text)
    rounds = [d for e, d in events if e == "round"]
    assert status == 200 and len(rounds) == 8
    for i, rnd in enumerate(rounds):
        (row,) = rnd["rows"]
        assert row["drafts"] == [] and row["accepted"] == 0 and not row["replaced"]
        assert row["closing"][0] == 2 + i  # left to right after the prompt
    assert events[-1][1]["speculative"] == {
        "passes": [8],
        "drafted": [0],
        "accepted": [0],
        "tokens": [8],
    }
    result, _, _ = direct(models["aogpt"][1], body)
    assert events[-1][1]["tokens"] == result.tokens.tolist()


def test_plain_modes_send_no_rounds(models) -> None:
    server = Running(models["armd"][1])
    try:
        status, text = server.post({"text": TEMPLATE, "mode": "random", "seed": 1})
        info = json.loads(server.get("/api/info")[1])
    finally:
        server.close()
    events = parse_sse(text)
    assert status == 200 and {e for e, _ in events} == {"start", "step", "done"}
    assert events[0][1]["speculative"] is None and "speculative" not in events[-1][1]
    assert info["speculative"] is True and info["limits"]["max_draft"] == 16


# ----------------------------------------------------------------------------- the field


@pytest.mark.parametrize(
    "body, message",
    [
        ({"speculative": True}, "field 'speculative' must be a whole number, not true"),
        ({"speculative": 2.0}, "field 'speculative' must be a whole number, not 2.0"),
        ({"speculative": "4"}, "field 'speculative' must be a whole number, not \"4\""),
        ({"speculative": [4]}, "field 'speculative' must be a whole number, not [4]"),
        (
            {"speculative": 0},
            "speculative=0 must lie in 1..16 (this server's limit; K is the most tokens one "
            "pass commits), e.g. 4",
        ),
        ({"speculative": -3}, "speculative=-3 must lie in 1..16 (this server's limit"),
        ({"speculative": 17}, "speculative=17 must lie in 1..16 (this server's limit"),
        (
            {"speculative": 10**40},
            "speculative=10000000000000000000... (41 digits) must lie in 1..16",
        ),
        (
            {"speculative": 2, "mode": "lemma1", "steps": 4},
            "speculative decoding follows one order, one exact token at a time: use mode "
            "random or l2r, not lemma1",
        ),
        (
            {"speculative": 2, "mode": "strided", "streams": 4},
            "speculative decoding follows one order, one exact token at a time: use mode "
            "random or l2r, not strided",
        ),
        (
            {"speculative": 2, "steps": 4},
            "speculative decoding takes no steps or streams (K sets the tokens per pass); leave "
            "them out",
        ),
        ({"speculative": 2, "mode": "l2r", "streams": 2}, "speculative decoding takes no steps"),
    ],
)
def test_speculative_field_is_checked(body: dict, message: str) -> None:
    with pytest.raises(SamplingError) as e:
        parse_request(body, Limits())
    assert str(e.value).startswith(message)


def test_speculative_field_takes_null_and_the_servers_limit() -> None:
    assert parse_request({"speculative": None}, Limits()).speculative is None
    assert parse_request({"speculative": 16, "mode": "l2r"}, Limits()).speculative == 16
    with pytest.raises(SamplingError, match=r"^speculative=3 must lie in 1\.\.2 "):
        parse_request({"speculative": 3}, Limits(max_draft=2))


@pytest.mark.parametrize("kind", ["gpt", "mdm"])
def test_models_that_cannot_draft_get_400(models, kind: str) -> None:
    server = Running(models[kind][1])
    try:
        status, text = server.post({"text": "ab", "mode": "l2r", "length": 8, "speculative": 2})
        info = json.loads(server.get("/api/info")[1])
    finally:
        server.close()
    assert status == 400 and json.loads(text)["error"] == (
        "speculative decoding needs a model that drafts positions ahead (aogpt or armd); this "
        f"one is {kind}: leave speculative out"
    )
    assert info["speculative"] is False


def test_hostile_speculative_bodies_get_400(models) -> None:
    """Raw bytes, no client library: huge numbers, exponents, a field twice, NaN."""
    server = Running(models["armd"][1])
    cases = [
        (b'{"speculative": 1' + b"0" * 400 + b"}", "speculative=10000000000000000000... (401"),
        (b'{"speculative": 1e999}', "field 'speculative' must be a whole number"),
        (b'{"speculative": 4e0}', "field 'speculative' must be a whole number, not 4.0"),
        (b'{"speculative": NaN}', "NaN is not a JSON number; send a finite number"),
        (b'{"speculative": 2, "speculative": 3}', "the body names the field 'speculative' twice"),
        (b'{"speculative": {"K": 2}}', "field 'speculative' must be a whole number, not {"),
        (b'{"speculative": false}', "field 'speculative' must be a whole number, not false"),
        (b'{"speculative": -9223372036854775809}', "speculative=-9223372036854775809 must lie"),
    ]
    try:
        for raw, message in cases:
            status, got = error_of(ask(server, post(raw)))
            assert status == 400 and got.startswith(message), (raw[:40], got)
        info_within_a_second(server)
    finally:
        server.close()


# ----------------------------------------------------------------------------- the page

# Records every cell of the first sample drawn as a pending draft, as it is drawn: a draft is
# on screen for a moment only, too short for polling the DOM.
RECORD_DRAFTS = """
window.drafted = [];
new MutationObserver((records) => {
  for (const r of records) {
    const c = r.target;
    if (c.classList.contains("drafted") && c.parentElement.id === "grid-0") {
      window.drafted.push([[...c.parentElement.children].indexOf(c), c.textContent]);
    }
  }
}).observe(document.getElementById("samples-out"),
           {subtree: true, attributes: true, attributeFilter: ["class"]});
"""


def test_page_shows_drafts_accepted_and_replaced_tokens(models, tmp_path) -> None:
    sync_playwright = _playwright()
    folder, loaded = models["armd"]
    body = {"text": TEMPLATE, "speculative": 3, "seed": 0}
    result, rounds, _ = direct(loaded, body)
    expected = anyorder.load(folder).infill(TEMPLATE, speculative=3, seed=0)
    stats = result.extra["speculative"]
    live = [(r["accepted"][0], r["position"][0], r["positions"][0]) for r in rounds]
    replaced = sum(a < len([p for p in ps if p < 17]) for a, _, ps in live)
    assert replaced >= 1 and int(stats.accepted[0]) >= 1  # the case shows both
    server = Running(loaded)
    shot = tmp_path / "serve-speculative.png"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 700})
                page.goto(server.url + "/")
                page.wait_for_selector("body[data-state=ready]", timeout=30_000)
                # the control: offered for random and l2r, with K only once chosen
                assert page.is_visible("#spec-box") and page.is_hidden("#draft-box")
                page.select_option("#mode", "lemma1")
                assert page.is_hidden("#spec-box")
                page.select_option("#mode", "random")
                page.check("#speculative")
                assert page.is_visible("#draft-box")
                page.fill("#text", TEMPLATE)
                page.fill("#draft", "3")
                page.fill("#seed", "0")
                page.fill("#delay", "300")  # slow motion: drafts stay pending on screen
                page.evaluate(RECORD_DRAFTS)
                page.click("#generate")
                page.wait_for_selector("body[data-state=done]", timeout=60_000)
                assert page.is_visible("#spec-legend") and page.is_hidden("#legend")
                # every draft the sampler checked was on screen, pending, before its verdict
                seen = page.evaluate("window.drafted")
                drafts = [(p, t) for r in rounds for p, t in zip(r["positions"][0], r["tokens"][0])]
                drafts = [(p, t) for p, t in drafts if p < 17]
                assert [x[0] for x in seen] == [p for p, _ in drafts]
                assert len(seen) == int(stats.drafted[0]) >= 3
                tok = loaded.tokenizer
                for (_, text), (_, t) in zip(seen, drafts):  # printable bytes as they are
                    piece = tok.decode([t])
                    if piece.isprintable() and piece != " ":
                        assert text == piece
                assert page.is_hidden("#error")
                assert page.input_value("#final-0") == expected
                assert page.locator("#grid-0 .cell.drafted").count() == 0
                assert page.locator("#grid-0 .cell.pending").count() == 0
                assert page.locator("#grid-0 .cell.discarded").count() == 0
                assert page.locator("#grid-0 .cell.known").count() == 8
                accepted = page.locator("#grid-0 .cell.accepted").count()
                swapped = page.locator("#grid-0 .cell.replaced")
                bonus = page.locator("#grid-0 .cell.bonus").count()
                assert accepted == int(stats.accepted[0])
                assert swapped.count() == replaced
                assert bonus == int(stats.passes[0]) - replaced
                assert accepted + swapped.count() + bonus == int(stats.tokens[0]) == 9
                # a replaced cell shows the rejected draft struck through, then its token
                assert page.locator("#grid-0 .cell.replaced s").count() == replaced
                _, pos, _ = next(x for x in live if x[0] < len([q for q in x[2] if q < 17]))
                cell = page.locator("#grid-0 .cell").nth(pos)
                assert "rejected in pass" in cell.get_attribute("title")
                p_, d_, a_ = (int(getattr(stats, k)[0]) for k in ("passes", "drafted", "accepted"))
                assert page.inner_text("#spec-counter") == (
                    f"{p_} passes / {d_} drafted / {a_} accepted ({int(100 * a_ / d_ + 0.5)}%)"
                )
                assert page.inner_text("#step-counter") == f"pass {p_}"  # no total to reach
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        server.close()
    assert shot.stat().st_size > 1000
