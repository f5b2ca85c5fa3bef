"""An open-loop load tool for the service's HTTP API (`python -m bench.openloop`).

A closed loop of N clients measures N / throughput: when the service slows down, the clients
send less, and the latency they see stays flat. Here requests arrive on a Poisson schedule
fixed in advance, whatever the service does, and each request's latency counts from its
*scheduled* time: a request that waits for the client's event loop, for a pooled connection
or for a server that stopped answering carries that wait in its latency (coordinated
omission, the failure of closed-loop tools, cannot happen).

    schedule.py  Poisson arrivals and the dispatcher that fires them (no HTTP)
    kinds.py     the request of each kind: segment, click, classify
    worker.py    one client process (asyncio) and the processes of one step
    wire.py      the lean HTTP/1.1 client it sends through (`--client httpx` to compare)
    pools.py     httpx clients in small pools, for `--client httpx`
    report.py    exact percentiles over every process's raw latencies, the table, the JSON
    phases.py    where each 200's latency went, hop by hop, from its `timing_ms`
"""
