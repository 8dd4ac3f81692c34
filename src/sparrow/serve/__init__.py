"""`sparrow serve`: an OpenAI-compatible HTTP server around one Pipeline (FastAPI + uvicorn, SSE, Prometheus).

    scheduler = Scheduler(lambda: sparrow.load("qwen2.5-coder-1.5b"), max_queue=32)
    app = create_app(scheduler, model_name="qwen2.5-coder-1.5b")   # uvicorn.run(app), or TestClient(app)

`Scheduler` (scheduler.py) owns the pipeline and runs requests from a bounded queue on one worker thread;
`create_app` (app.py) is the HTTP layer; protocol.py the request bodies; metrics.py the Prometheus metrics.
Needs the `serve` extra: `pip install 'sparrow[serve]'`.
"""

from sparrow.serve.app import create_app
from sparrow.serve.metrics import Metrics
from sparrow.serve.scheduler import Scheduler

__all__ = ["Metrics", "Scheduler", "create_app"]
