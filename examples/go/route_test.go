package main

import (
	"fmt"
	"testing"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

func sampler(address string, state pb.ReplicaState, base string) *pb.Replica {
	return &pb.Replica{Address: address, Role: pb.ReplicaRole_REPLICA_ROLE_SAMPLER, State: state, BaseFingerprint: base}
}

// The test vector of docs/fleet.md, which the Python router's test checks too.
func TestScoreMatchesTheDocumentedVector(t *testing.T) {
	if got := score("team-a/agent", "10.0.0.1:7101"); got != 12088528084577892006 {
		t.Fatalf("score = %d, want 12088528084577892006", got)
	}
}

func TestDrainingAndOtherBasesAreNeverChosen(t *testing.T) {
	serving := pb.ReplicaState_REPLICA_STATE_SERVING
	fleet := []*pb.Replica{
		sampler("10.0.0.1:7101", pb.ReplicaState_REPLICA_STATE_DRAINING, "b"),
		sampler("10.0.0.2:7101", serving, "other"),
		sampler("10.0.0.3:7101", serving, "b"),
	}
	for i := 0; i < 50; i++ {
		order := route(fmt.Sprintf("a%d", i), fleet, "b", map[string]int{}, 0.25)
		if len(order) != 1 || order[0].GetAddress() != "10.0.0.3:7101" {
			t.Fatalf("route chose %v", order)
		}
	}
}

// One hot adapter: no replica holds more than ceil((1+eps) x average) plus one request in flight.
func TestAHotAdapterSpillsWithinTheBound(t *testing.T) {
	var fleet []*pb.Replica
	for i := 1; i <= 3; i++ {
		fleet = append(fleet, sampler(fmt.Sprintf("10.0.0.%d:7101", i), pb.ReplicaState_REPLICA_STATE_SERVING, "b"))
	}
	inFlight := map[string]int{}
	for n := 0; n < 60; n++ {
		inFlight[route("hot", fleet, "b", inFlight, 0.25)[0].GetAddress()]++
	}
	for address, held := range inFlight {
		if held > loadBound(59, 3, 0.25) {
			t.Fatalf("%s holds %d of 60", address, held)
		}
	}
	if home := hashOrder("hot", fleet)[0].GetAddress(); inFlight[home] < 20 {
		t.Fatalf("the home replica %s holds only %d", home, inFlight[home])
	}
}
