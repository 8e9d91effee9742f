"""Where a decode worker's host time goes, per call: wall and thread-CPU microseconds of the functions on a load's
path, in every kvbridge process started with `KVB_PROF_DIR` set and this folder first on `PYTHONPATH`:

    KVB_PROF_DIR=$OUT/prof PYTHONPATH=$PWD/src:$PWD/bench/host_profile python3 bench/gpu_workers.py --decode-gpu 0 \
        --pairs 'pp2->tp2' --paths auto --claims on --repeats 30
    python3 bench/host_profile/summarize.py $OUT/prof

Each wrapped function is timed per call and per thread (about 1 us of overhead per call); a decode worker writes
its calls to `prof-decode-<pid>.json` in `KVB_PROF_DIR` when it closes. Wall time close to CPU time means the thread
ran all along (no lock or GIL wait, no sleep). Nothing happens without `KVB_PROF_DIR`. To profile another tree
(`git archive` of a commit), put that tree's `src` on `PYTHONPATH` right after this folder: the wrapping imports
kvbridge as the interpreter starts, before the bench puts its own tree first.
"""

import os

if os.environ.get("KVB_PROF_DIR"):
    import functools
    import json
    import threading
    import time

    _CALLS: dict[str, list[tuple[float, float]]] = {}
    _LOCK = threading.Lock()

    def _wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None or getattr(fn, "_timed", False):
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
                key = f"{threading.current_thread().name[:24]}|{label}"
                with _LOCK:
                    _CALLS.setdefault(key, []).append((wall / 1e3, cpu / 1e3))

        timed._timed = True
        setattr(owner, name, timed)

    def _dump() -> None:
        folder = os.environ["KVB_PROF_DIR"]
        os.makedirs(folder, exist_ok=True)
        with _LOCK:
            calls = dict(_CALLS)
        with open(os.path.join(folder, f"prof-decode-{os.getpid()}.json"), "w") as f:
            json.dump(calls, f)

    def _install() -> None:
        from kvbridge.runtime import claims, ipc_reads, notifier, peers, read_budget
        from kvbridge.runtime import decode_worker as dw
        from kvbridge.transport import gpu_gather, ipc_reader
        from kvbridge.wire import auth
        from kvbridge.wire import messages as wire
        from kvbridge.wire import side_channel_client as scc

        worker = dw.DecodeWorker
        for name in ("load", "_admit", "_claim_step", "_claim", "_launch_in_claim", "_complete", "_copied", "_report"):
            _wrap(worker, name, "DecodeWorker." + name)
        _wrap(worker, "results", "DecodeWorker.results")
        _wrap(dw, "check_run", "check_run")
        _wrap(claims, "claim_reads", "claim_reads")
        _wrap(claims, "groups_digest", "groups_digest")
        _wrap(claims.ClaimQueue, "admit", "ClaimQueue.admit")
        _wrap(wire, "encode", "wire.encode")
        _wrap(auth.Sealer, "seal_request", "Sealer.seal_request")
        _wrap(scc.SideChannelClient, "exchange_all", "SideChannelClient.exchange_all")
        _wrap(scc.SideChannelClient, "_socket", "SideChannelClient._socket")
        _wrap(ipc_reads.IpcReads, "_checked", "IpcReads._checked")
        _wrap(ipc_reads.IpcReads, "launch", "IpcReads.launch")
        _wrap(ipc_reads.IpcReads, "_finish", "IpcReads._finish")
        _wrap(ipc_reader.IpcReader, "launch", "IpcReader.launch")
        _wrap(ipc_reader.IpcReader, "_upload", "IpcReader._upload")
        _wrap(gpu_gather.GatherKernel, "launch", "GatherKernel.launch")
        _wrap(peers.PeerBook, "begin", "PeerBook.begin")
        _wrap(peers.PeerBook, "connect", "PeerBook.connect")
        _wrap(peers.PeerBook, "end", "PeerBook.end")
        _wrap(read_budget.ReadBudget, "begin", "ReadBudget.begin")
        _wrap(notifier.Notifier, "tell", "Notifier.tell")
        _wrap(notifier.Notifier, "notify_message", "Notifier.notify_message")
        # the NIXL path: a load's descriptors, and each READ's arrays, checks and post
        from kvbridge.runtime import nixl_reads
        from kvbridge.transport import nixl

        for name in ("post", "_descriptors"):
            _wrap(nixl_reads.NixlReads, name, "NixlReads." + name)
        _wrap(nixl_reads, "group_descriptors", "group_descriptors")
        for name in ("read", "_post", "_mem_type_of"):
            _wrap(nixl.NixlTransport, name, "NixlTransport." + name)
        _wrap(nixl, "descriptor_arrays", "descriptor_arrays")
        close = worker.close

        def close_and_dump(self):
            _dump()
            return close(self)

        worker.close = close_and_dump

    try:
        _install()
    except Exception as exc:  # a profile must never break the process it watches
        print(f"host_profile: not installed: {exc!r}")
