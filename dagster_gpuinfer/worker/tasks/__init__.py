"""Tasks: the task table's worker half and what each task needs to read, check and answer a row.

`table` holds one `WorkerTask` per task (`worker_task(name)`); `pooling` (score, classify),
`image` (image embed, vision chat), `images` (decoding) and `image_fit` (the model's own
resize) are the task families' own steps; `params` (request models), `structured`,
`completions` and `openai_batch` are the row formats the tasks produce and accept. Imports
nothing of the other stages: rows, loop and run call into it, and a task calls them back
through the Protocols of `stages` (reader, validator, request builder, engine).
"""
