"""Take the screenshot of ``docs/serve.md``: ``anyorder serve`` on a model, in headless Chromium.

::

    .venv/bin/python docs/shoot_serve.py                 # the main job's model (runs/demo)
    .venv/bin/python docs/shoot_serve.py CHECKPOINT --out docs/img/serve.png
    .venv/bin/python docs/shoot_serve.py --speculative 4 --out docs/img/serve-speculative.png

Needs Debian's ``chromium`` and the ``playwright`` package (the dev extras); it starts the
server in this process on a free port, fills in a template, generates with Lemma-1 steps (or
speculatively in random order, ``--speculative K``) and a fixed seed, and saves the finished
page.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

DOCS = Path(__file__).resolve().parent
# 119 tokens: it fits the demo model's context of 128
TEMPLATE = "The [MASK:16] statement is used to [MASK:32]. It is [MASK:12] when the loop ends.\n"


def main() -> None:
    from playwright.sync_api import sync_playwright

    from anyorder.interop.hub import load_any
    from anyorder.serve import DEFAULT_CHECKPOINT, App, make_server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", default=DEFAULT_CHECKPOINT)
    p.add_argument("--out", default=str(DOCS / "img" / "serve.png"))
    p.add_argument("--template", default=TEMPLATE)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", type=int, default=None, metavar="K")
    args = p.parse_args()

    server = make_server(App(load_any(args.checkpoint)), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    chromium_args = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ]  # fmt: skip
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=chromium_args)
            page = browser.new_page(viewport={"width": 1000, "height": 560})
            page.goto(url)
            page.wait_for_selector("body[data-state=ready]")
            page.fill("#text", args.template)
            if args.speculative is None:
                page.select_option("#mode", "lemma1")
                page.fill("#steps", str(args.steps))
            else:
                page.select_option("#mode", "random")
                page.check("#speculative")
                page.fill("#draft", str(args.speculative))
            page.fill("#seed", str(args.seed))
            page.fill("#temperature", "0.8")
            page.click("#generate")
            ended = "body:is([data-state=done], [data-state=error])"
            page.wait_for_selector(ended, timeout=120_000)
            if page.get_attribute("body", "data-state") == "error":  # refused: say why, at once
                raise SystemExit(f"shoot_serve: {page.text_content('#error')}")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            print(page.input_value("#final-0"))
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
