package main

import (
	"context"
	"fmt"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

// watchAdapter opens a registry event stream for one adapter and returns once the registry has answered
// (its first message is a Reconcile snapshot, asked for by send_snapshot), so no later change is missed.
// Events arrive on the channel, which closes when the stream ends.
func watchAdapter(ctx context.Context, registry pb.RegistryServiceClient, adapter string) (<-chan *pb.Event, error) {
	stream, err := registry.WatchEvents(ctx, &pb.WatchEventsRequest{Adapters: []string{adapter}, SendSnapshot: true})
	if err != nil {
		return nil, fmt.Errorf("WatchEvents: %w", err)
	}
	first, err := stream.Recv()
	if err != nil {
		return nil, fmt.Errorf("WatchEvents: %w", err)
	}
	fmt.Printf("watching %s from event %s\n", adapter, first.GetReconcile().GetEventId())
	events := make(chan *pb.Event, 16)
	go func() {
		defer close(events)
		for {
			message, err := stream.Recv()
			if err != nil {
				return // the context ends the stream when main returns
			}
			if event := message.GetEvent(); event != nil {
				events <- event
			}
		}
	}()
	return events, nil
}

// awaitPublished prints the adapter's events until the one announcing the given version.
func awaitPublished(ctx context.Context, events <-chan *pb.Event, version uint64) error {
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("no VERSION_PUBLISHED event for version %d: %w", version, ctx.Err())
		case event, open := <-events:
			if !open {
				return fmt.Errorf("event stream ended before version %d was announced", version)
			}
			fmt.Printf("event %s %s version %d aliases %v id %s\n",
				event.GetType(), event.GetAdapter(), event.GetVersion(), event.GetAliases(), event.GetEventId())
			if event.GetType() == pb.EventType_EVENT_TYPE_VERSION_PUBLISHED && event.GetVersion() == version {
				return nil
			}
		}
	}
}
