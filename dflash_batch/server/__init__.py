"""``dflash-batch serve``: OpenAI's Files and Batches API (and a status page) over the job home
and queue that ``submit`` and the workers use. No module here imports MLX or the engine; an
in-process worker (``--worker``) loads the engine through the worker's own code path, lazily.

``files.py`` keeps uploaded and produced files, ``batches.py`` maps a batch onto a job and its
lifecycle onto the job's state, ``page.py`` draws the status page, ``app.py`` is the HTTP layer.
"""
