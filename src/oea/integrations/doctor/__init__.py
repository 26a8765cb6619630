"""``oea doctor``: is each installed engine's OEA hook live in this interpreter? Engine-independent; each engine's
own checks are its adapter's ``doctor.py`` (``oea.integrations.<engine>.doctor``), imported lazily.

One job per file:

* ``run.py``: runs the engines' checks and the environment's, and prints the report (``run_doctor``,
  ``format_text``);
* ``cli.py``: the ``oea doctor`` command (listed in ``oea.cli.COMMAND_MODULES``); ``oea doctor gpu`` is
  ``oea.kernels.doctor_gpu``, beside the kernels it checks;
* ``common.py``: the pieces every engine's doctor uses (the check record, ``check_call``, installed versions,
  the entry-point checks);
* ``env.py``: the check of the ``OEA_*`` environment, each variable parsed as the engines parse it;
* ``judge.py``: the verdicts on what a server served (OEA engaged, active experts, padding, reasons), shared by
  ``--metrics-file`` and ``--metrics-url``;
* ``live.py``: ``oea doctor --metrics-url``: a running server's ``oea_*`` Prometheus series read over HTTP.

What a server's ``OEA_METRICS_FILE`` says (``oea doctor --metrics-file``) is ``oea.integrations.served``.
Modules import each other by full module path; importing this package imports nothing.
"""
