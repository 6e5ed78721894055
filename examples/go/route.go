package main

// The fleet's routing rule (docs/fleet.md, "The routing rule") in Go, from ListReplicas: what
// opentinker.client.fleet_router does in Python, so a Go service sends each adapter to the same replica.

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"sort"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

// score is the rendezvous weight of address for adapter: SHA-256 of adapter+"\n"+address, first 8 bytes big-endian.
func score(adapter, address string) uint64 {
	sum := sha256.Sum256([]byte(adapter + "\n" + address))
	return binary.BigEndian.Uint64(sum[:8])
}

// candidates are the serving samplers of one base; draining replicas and other bases are never chosen.
func candidates(replicas []*pb.Replica, base string) []*pb.Replica {
	var out []*pb.Replica
	for _, r := range replicas {
		if r.GetRole() == pb.ReplicaRole_REPLICA_ROLE_SAMPLER && r.GetState() == pb.ReplicaState_REPLICA_STATE_SERVING &&
			(base == "" || r.GetBaseFingerprint() == base) {
			out = append(out, r)
		}
	}
	return out
}

// hashOrder sorts replicas by descending score for adapter, ties by address.
func hashOrder(adapter string, replicas []*pb.Replica) []*pb.Replica {
	ordered := append([]*pb.Replica(nil), replicas...)
	sort.SliceStable(ordered, func(i, j int) bool {
		si, sj := score(adapter, ordered[i].GetAddress()), score(adapter, ordered[j].GetAddress())
		if si != sj {
			return si > sj
		}
		return ordered[i].GetAddress() < ordered[j].GetAddress()
	})
	return ordered
}

// loadBound is how many requests in flight a replica may hold before it is skipped, counting the one placed.
func loadBound(inFlight, replicas int, eps float64) int {
	if replicas < 1 {
		replicas = 1
	}
	return int(math.Ceil((1 + eps) * float64(inFlight+1) / float64(replicas)))
}

// route gives every candidate best first: the first in hash order under the load bound, then the rest in hash
// order (where to retry). inFlight counts this caller's requests per address.
func route(adapter string, replicas []*pb.Replica, base string, inFlight map[string]int, eps float64) []*pb.Replica {
	ordered := hashOrder(adapter, candidates(replicas, base))
	total := 0
	for _, r := range ordered {
		total += inFlight[r.GetAddress()]
	}
	bound := loadBound(total, len(ordered), eps)
	for i, r := range ordered {
		if inFlight[r.GetAddress()] < bound {
			return append([]*pb.Replica{r}, append(append([]*pb.Replica(nil), ordered[:i]...), ordered[i+1:]...)...)
		}
	}
	return ordered
}

// fleetSampler is the address of the replica that takes adapter's next request, from the registry's listing.
func fleetSampler(ctx context.Context, registry pb.RegistryServiceClient, adapter string) (string, error) {
	got, err := registry.GetAdapter(ctx, &pb.GetAdapterRequest{Name: adapter})
	if err != nil {
		return "", fmt.Errorf("GetAdapter: %w", err)
	}
	listed, err := registry.ListReplicas(ctx, &pb.ListReplicasRequest{Role: pb.ReplicaRole_REPLICA_ROLE_SAMPLER})
	if err != nil {
		return "", fmt.Errorf("ListReplicas: %w", err)
	}
	order := route(adapter, listed.GetReplicas(), got.GetAdapter().GetBaseModelDigest(), map[string]int{}, 0.25)
	if len(order) == 0 {
		return "", fmt.Errorf("no serving sampler of base %s in the fleet", got.GetAdapter().GetBaseModelDigest())
	}
	fmt.Printf("routed %s to %s of %d replicas\n", adapter, order[0].GetAddress(), len(listed.GetReplicas()))
	return order[0].GetAddress(), nil
}
