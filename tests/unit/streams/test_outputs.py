"""Every path that publishes a stream core's outputs gives the same records under the same ids
(the Faust worker is compared with the bus service in tests/integration/test_embedded_vs_faust.py)."""

import asyncio

from kvguard.bus.inproc import InprocBus
from kvguard.config.settings import Settings
from kvguard.runtime.bootstrap import bootstrap
from kvguard.runtime.embedded import demo_workload, run_embedded
from kvguard.runtime.mapping import stream_config
from kvguard.streams.embedded import StreamsService
from kvguard.wire.schemas import batch_headers, encode_batch


async def published(bus: InprocBus, settings: Settings, kind: str) -> dict[str, bytes]:
    sub = bus.subscribe([settings.topics.name(kind)], "check")
    return {dict(r.headers)["ce_id"].decode(): r.value for r in await sub.getmany(100_000, 0)}


def test_the_demo_loop_and_the_bus_service_publish_the_same_alert_records_under_the_same_ids():
    settings = Settings()
    graph = bootstrap(settings, predictor=None)
    workload = demo_workload(graph.profile, workload="mixed", rate_scale=2.25, duration_s=600, seed=0)
    demo_bus, batches = InprocBus.from_settings(settings), []
    asyncio.run(run_embedded(graph, workload, n_gpus=2, duration_s=600, seed=0, guarded=False, bus=demo_bus,
                             on_batches=batches.extend))

    async def through_the_service() -> InprocBus:
        bus = InprocBus.from_settings(settings)
        for b in batches:
            await bus.publish(settings.topics.name("events"), b.node, encode_batch(b), batch_headers(b))
        await StreamsService(bus, settings, config=stream_config(settings)).run(idle_timeout_s=0.3)
        return bus

    service_bus = asyncio.run(through_the_service())
    for kind in ("alerts", "metrics"):
        demo = asyncio.run(published(demo_bus, settings, kind))
        service = asyncio.run(published(service_bus, settings, kind))
        assert service, f"the run raised no {kind}: the comparison would be empty"
        # the demo loop also flushes each node at the end of the run, so it may have a few more
        assert {rid: demo.get(rid) for rid in service} == service
    alert_ids = asyncio.run(published(service_bus, settings, "alerts"))
    assert all(rid.rsplit("/", 2)[-1] in ("firing", "resolved") for rid in alert_ids)
