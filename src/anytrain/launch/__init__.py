"""Launching anytrain on clusters: rank discovery under torchrun / srun / mpirun (``env``), and the job scripts and
command lines ``anytrain launch slurm|mpi`` writes (``slurm``, ``mpi``). Discovery (``env``) imports
no torch."""
