"""The job's ranks: who this process is (world), checks all ranks pass alike (agree)."""
