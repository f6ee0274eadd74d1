"""What does handing events from a worker thread to a busy asyncio event loop cost, one call each or all at once?

    python -m benchmarks.probes.handover_probe [--events 256] [--switch-interval-ms 0.5]

The server's engine thread hands each visit's events (every request's new tokens, then its ends) to the HTTP
event loop with loop.call_soon_threadsafe. Here the loop runs Python work that yields often (as a loop serving
hundreds of streams does) while a second thread hands over `--events` events, one call each and then in one call
(serve/_runner.py deliver), 20 times each; printed: milliseconds a visit's worth of events takes to hand over.
"""

import argparse
import asyncio
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--switch-interval-ms", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    print({"python": sys.version.split()[0], **vars(args), **asyncio.run(measure(args.events, args.repeats))})


async def measure(count: int, repeats: int) -> dict:
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(count)]
    stopping = False

    async def busy():
        while not stopping:
            sum(range(2000))
            await asyncio.sleep(0)

    def put_all(items):
        for queue, event in items:
            queue.put_nowait(event)

    result = {}

    def worker():
        for mode in ("one_call_each_ms", "one_call_ms"):
            start = time.perf_counter()
            for _ in range(repeats):
                if mode == "one_call_each_ms":
                    for queue in queues:
                        loop.call_soon_threadsafe(queue.put_nowait, ("tokens", [1, 2, 3, 4]))
                else:
                    loop.call_soon_threadsafe(put_all, [(queue, ("tokens", [1, 2, 3, 4])) for queue in queues])
            result[mode] = round((time.perf_counter() - start) / repeats * 1e3, 3)

    task = asyncio.create_task(busy())
    thread = threading.Thread(target=worker)
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.01)
    stopping = True
    await task
    return result


if __name__ == "__main__":
    main()
