"""``anyorder serve``: a local web page that shows any-order generation as it happens.

The page (``anyorder/web``: plain HTML, JS and CSS, no build) sends a prompt or a template
with holes (``[MASK:n]``) and the sampling controls; the server runs the library's own fast
sampler (:func:`anyorder.sample.sample`) and streams every forward pass to the page as a
server-sent event: the positions decided, their tokens and text, and the step recorded in
``step_of``. The page only draws what it receives; it never samples.

Design choices:

* Standard library only (:mod:`http.server`): no new dependency, and page loads are
  answered while a generation runs.
* The stream *is* the sampler: one ``step`` event per call of the sampler's ``on_step``
  hook, so the events rebuild its :class:`~anyorder.sample.SampleResult` exactly (tokens
  and ``step_of``); ``done`` carries the result itself. Speculative decoding adds a
  ``round`` event per pass from the sampler's ``on_round`` hook (drafts checked, accepted,
  replaced), which the page shows as it happens.
* Validation is the sampler's: the response headers are sent at the first pass, so every
  :class:`~anyorder.errors.AnyorderError` raised before it (a bad template, a length over
  the context, a mode the model cannot run) becomes a 400 with its one-line message, and
  the server needs no second copy of those checks. Errors after it arrive as an ``error``
  event. Unexpected exceptions become a 500 or an ``error`` event; the server keeps going.
* Bounded requests (:class:`Limits`): body size (413), samples per request, length (the
  model's context, checked by the sampler), wall-clock time per request (checked after
  every pass; the hook raises to stop the sampler), and one generation at a time (429 with
  ``Retry-After`` while busy), and per connection: one deadline for the whole request (408),
  requests answered at once (503), the time an answer may take to be read. A client that
  goes away stops its generation at the next pass (the write fails).
* Binds ``127.0.0.1`` by default: the page is meant for the machine it runs on.
* ``tokens/s`` counts generated tokens over the time spent outside the optional
  slow-motion pause (``delay_ms``, for watching a fast model fill in).

Endpoints: ``GET /`` (the page), ``GET /static/<file>``, ``GET /api/info`` (the model and
the limits), ``POST /api/generate`` (JSON in, ``text/event-stream`` out: ``start``,
``step``... (each after its ``round`` when speculative), then ``done`` or ``error``).

Modules: :mod:`~anyorder.serve.generation` (one request: checks, the sampler's arguments,
the run and its events), :mod:`~anyorder.serve.server` (the HTTP server and the page),
:mod:`~anyorder.serve.guard` (checks on raw HTTP requests), :mod:`~anyorder.serve.intake`
(reading requests whole in one thread, writing answers before a deadline).
"""

from anyorder.serve.generation import (
    MAX_DRAFT,
    MAX_TIME_LIMIT_S,
    MODES,
    MODES_OF_KIND,
    GenRequest,
    LimitError,
    Limits,
    Plan,
    parse_request,
    plan_request,
    run_generation,
)
from anyorder.serve.server import DEFAULT_CHECKPOINT, STATIC, App, make_server, serve

__all__ = [
    "DEFAULT_CHECKPOINT",
    "MAX_DRAFT",
    "MAX_TIME_LIMIT_S",
    "MODES",
    "MODES_OF_KIND",
    "STATIC",
    "App",
    "GenRequest",
    "LimitError",
    "Limits",
    "Plan",
    "make_server",
    "parse_request",
    "plan_request",
    "run_generation",
    "serve",
]
