"""A run's directory and how a command line ends.

- ``files``: the files of a run directory, written atomically, and a result's provenance;
- ``lock``: one process per run directory (a Hydra callback);
- ``records``: a run directory's ``.hydra`` record kept when lowmem does not run the job;
- ``refusals``: what a refusal is, printed as one line;
- ``command``: what ``lowmem.train`` / ``profile`` / ``plan`` do with a refusal, a signal or a
  knob that does not exist.

Nothing here imports the trainer, the techniques or the profiler.
"""
