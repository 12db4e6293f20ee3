"""Rows: reading shards into chunks (`readers`), validating and tokenizing rows
(`validate`), a row's request from its parameters (`request_params`), and a chunk's output
tables and lines (`writers`). Each asks the task table (`worker.tasks`) what its task does.
"""
