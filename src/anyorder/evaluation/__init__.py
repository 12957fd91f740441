"""Evaluation: likelihoods, their error bars and reports, the zero-shot protocol and
generative perplexity (layer 5: it imports the core, data, checkpoints and sampling, never
training or the applications).

* :mod:`~anyorder.evaluation.estimators`: per-batch likelihoods (left to right, any order,
  the encoder's ELBO), context-order ensembles (Eq. 7) and the exact enumerations (Eq. 5);
* :mod:`~anyorder.evaluation.corpus`: the same per block of a corpus, reproducible draws;
* :mod:`~anyorder.evaluation.suite`: every likelihood that applies to a model, with error
  bars over blocks (:func:`~anyorder.evaluation.suite.likelihood_suite`);
* :mod:`~anyorder.evaluation.report`: the text of a likelihood result;
* :mod:`~anyorder.evaluation.zeroshot`: the zero-shot sets, their splits, reading and
  packing; :mod:`~anyorder.evaluation.detokenize`: their detokenizers;
* :mod:`~anyorder.evaluation.zeroshot_table`: the run over the sets and the paper's table;
* :mod:`~anyorder.evaluation.genppl`: generative perplexity and entropy with a judge model.

The package imports nothing itself: each user imports the submodule it needs.
"""
