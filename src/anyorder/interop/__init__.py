"""Interop: other people's formats and places, to and from ours.

* :mod:`~anyorder.interop.hub`: the Hugging Face hub (hub ids, uploads), :func:`load_any`
  for whatever a user names, and ``train.init_from``;
* :mod:`~anyorder.interop.convert`: a ``transformers`` GPT-2 checkpoint -> gpt, aogpt, armd;
* :mod:`~anyorder.interop.reference`: the AO-GPT authors' checkpoints -> aogpt (their
  state-dict names: :mod:`~anyorder.interop.reference_names`).

This layer sits beside :mod:`anyorder.checkpoint` and imports it (exported folders are read
and written there); checkpoint never imports interop. Nothing here is imported by
``import anyorder`` or by this package's ``__init__``: importing a module of it is a choice.
"""
