"""The command-line wing: `spotfill`, one module per verb (argparse adapters over the domain
packages), the temporary Prefect server of `spotfill run`. The only importer of flows/."""
