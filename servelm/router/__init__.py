"""A cache-aware router in front of servelm servers (or any OpenAI-compatible ones):
`servelm router --backend URL ...`, and the front of `servelm serve --data-parallel-size N`.

policy.py    which backend a request goes to (cache_aware, least_loaded, round_robin)
prompts.py   a request's prompt tokenised as the backend will, and its block digests
app.py       Router: the backends' monitors (health, cache events), the proxy, /v1/stats
             and /metrics over every backend
replicas.py  N `servelm serve` children, each pinned to its share of the cores, restarted
serve.py     the two commands' processes
"""
