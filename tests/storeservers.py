"""Real object-store servers on loopback for the tests: moto in server mode (S3) and Azurite (Azure Blob).

Each runs as its own process on a free port and is reached only through the standard environment variables
(``env()``), as a deployment reaches a real bucket. Moto runs with IAM enforced (after the set-up calls), so
wrong credentials get the 403 a real S3 gives. Azurite is installed by ``make azurite`` into build/azurite.
gcp-storage-emulator is not here: it serves only GCS's JSON API and obstore speaks its XML API (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AZURITE = ROOT / "build" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BUCKET = "opentinker-test"
AZURITE_FLAGS = ("--skipApiVersionCheck", "--loose", "--silent")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout_s} s")


@dataclass
class StoreServer:
    scheme: str
    port: int
    process: subprocess.Popen[bytes]
    credentials: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The environment a process needs to reach this server's bucket with valid credentials."""
        return dict(self.credentials)

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_moto(log_dir: Path, *, port: int = 0, enforce_iam: bool = True) -> StoreServer:
    """moto_server with one bucket and one IAM user allowed s3:*; every later call must be signed by it.
    enforce_iam=False: any credentials are accepted (a server a test stops and starts again on ``port``, whose
    clients keep the credentials they started with)."""
    import boto3

    port = port or free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if enforce_iam:
        # The first four calls (bucket, user, policy, key) are let through unsigned; from then on IAM is enforced.
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
    log = (log_dir / "moto.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env, stdout=log, stderr=log
    )
    wait_for_port(port, process, "moto_server")
    setup = {"endpoint_url": endpoint, "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
    boto3.client("s3", region_name="us-east-1", **setup).create_bucket(Bucket=BUCKET)
    if not enforce_iam:
        plain = {"AWS_ACCESS_KEY_ID": "any", "AWS_SECRET_ACCESS_KEY": "any", "AWS_REGION": "us-east-1"}
        return StoreServer("s3", port, process, {**plain, "AWS_ENDPOINT_URL": endpoint})
    iam = boto3.client("iam", region_name="us-east-1", **setup)
    iam.create_user(UserName="opentinker")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="opentinker", PolicyName="bucket", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="opentinker")["AccessKey"]
    credentials = {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    return StoreServer("s3", port, process, credentials)


def start_azurite(data_dir: Path) -> StoreServer:
    """azurite-blob with one container, in data_dir."""
    from azure.storage.blob import BlobServiceClient

    if not AZURITE.exists():
        raise RuntimeError(f"{AZURITE} is missing: run `make azurite` (npm installs it into build/azurite)")
    port = free_port()
    log = (data_dir / "azurite.log").open("wb")
    process = subprocess.Popen(
        [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data_dir), *AZURITE_FLAGS],
        stdout=log,
        stderr=log,
    )
    wait_for_port(port, process, "azurite-blob")
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    BlobServiceClient.from_connection_string(connection).create_container(BUCKET)
    return StoreServer("az", port, process, {"AZURE_STORAGE_CONNECTION_STRING": connection})
