"""Batch rendering (`avatarstream batch`, issue 42): a CSV, JSONL or Parquet file of rows -> a
folder of signed videos, on Ray Data (an actor pool of renderers, each loading its model once),
resumable and exactly-once through a SQLite manifest. `jobs.py` reads and checks the rows,
`manifest.py` records them, `run.py` is the Ray pipeline, `cli.py` the command. On the inference
path: it imports neither training, data, evaluation nor benchmarks."""
