"""Drafter training pipeline (issue 5): generate -> extract -> train -> validate -> package.

Entry points: ``flexspec train-drafter`` (typer) and ``python -m flexspec.train.run_device`` (argparse only,
for machines without typer/rich). Both build one :class:`flexspec.train.config.TrainConfig` and call
:func:`flexspec.train.pipeline.run`. Methods plug in through :mod:`flexspec.train.methods`."""
