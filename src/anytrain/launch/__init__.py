"""Launching anytrain on clusters: the job scripts and command lines ``anytrain launch slurm|mpi`` writes (``slurm``,
``mpi``, with the vendor's collective environment from ``vendor``), and the recipe check both make before writing
anything (``recipe``). Rank discovery under torchrun / srun / mpirun is ``anytrain.parallel.env``."""
