"""Two tenants' adapters on one base model: start the stack, train, save, sample the saved version, roll back.
Run: python examples/quickstart.py [RUN_DIR]  (about 30 s on 2 CPU cores; stops everything at the end)"""

import json
import subprocess
import sys
import time
from pathlib import Path

from opentinker.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

run = Path(sys.argv[1] if len(sys.argv) > 1 else "quickstart-run").resolve()
subprocess.run(["opentinker", "make-tiny-model", str(run / "model")], check=True)  # random weights, made here
(run / "stack.toml").write_text(f'model = "{run}/model"\nport = 0\n[registry]\ndata_dir = "{run}/registry-data"\n')
up = subprocess.Popen(["opentinker", "up", "--config", run / "stack.toml", "--workdir", run, "--json"], stdout=-1)
servers = {name: server["address"] for name, server in json.loads(up.stdout.readline())["servers"].items()}  # type: ignore[union-attr]
tokens = list(range(10, 42))
datum = Datum(ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 31})
with ServiceClient(servers["trainer"], servers["sampler"], servers["registry"]) as service:
    for adapter in ("team-a/chat", "team-b/chat"):
        training = service.create_training_client(adapter)
        for _ in range(3):
            loss = training.forward_backward([datum]).metrics["loss:sum"]
            training.optim_step(AdamParams(learning_rate=1e-2))
            print(f"saved {training.save_snapshot().reference} (loss before the step {loss:.2f})")
    chat = service.create_sampling_client("team-a/chat")  # = team-a/chat@latest, resolved per request
    print("sampled from", chat.sample(tokens[:8], SamplingParams(max_tokens=8)).sequences[0].version.exact)
    moved = service.registry_client().rollback("team-a/chat")  # latest goes back to the version before
    print(f"rolled back team-a/chat@latest: {moved.previous_version} -> {moved.version}")
    while (served := chat.sample(tokens[:8]).sequences[0].version.exact) != f"team-a/chat@{moved.version}":
        time.sleep(0.05)  # the sampler follows the registry's events; a reload takes milliseconds
    print("now sampling from", served)
up.terminate()
sys.exit(up.wait())
