"""``shmkv serve``: the supervisor and gunicorn in one command, and how its workers load a
model (the HTTP app itself lives in ``workers/``, installed as ``shmkv_workers``)."""
