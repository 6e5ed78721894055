// Command opentinker-go-example drives the three OpenTinker servers from Go through stubs generated from
// protos/opentinker/v1: it creates an adapter, trains one step, publishes a snapshot, streams a sample from
// that exact version (from --sampler, or from the replica the fleet's routing rule picks), watches the registry announce it, and decodes the ErrorInfo of a refused call.
//
// Every result is one line ("adapter created ...", "loss ...", "version N ...", "sampled K tokens ...",
// "event ...", "error ...") so that scripts and tests can check it. Any unexpected failure exits 1.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

type options struct {
	registry, trainer, sampler string
	adapter, token             string
	timeout                    time.Duration
}

func parseFlags() options {
	var o options
	flag.StringVar(&o.registry, "registry", "127.0.0.1:7070", "registry address")
	flag.StringVar(&o.trainer, "trainer", "127.0.0.1:7071", "trainer address")
	flag.StringVar(&o.sampler, "sampler", "127.0.0.1:7072", `sampler address, or "fleet": the replica the routing rule picks from the registry's ListReplicas`)
	flag.StringVar(&o.adapter, "adapter", fmt.Sprintf("go-example-%x", time.Now().UnixNano()), "adapter name to create")
	flag.StringVar(&o.token, "token", os.Getenv("OPENTINKER_TOKEN"), "bearer token (env OPENTINKER_TOKEN)")
	flag.DurationVar(&o.timeout, "timeout", 60*time.Second, "deadline for the whole run")
	flag.Parse()
	return o
}

func main() {
	o := parseFlags()
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	if o.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+o.token)
	}
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "go example failed:", err)
		os.Exit(1)
	}
	fmt.Println("ok")
}

// dial connects without TLS (the servers bind loopback when they run without tokens).
// grpc-go 1.33 (Debian 12): DialContext + WithInsecure; newer releases spell it grpc.NewClient + insecure creds.
func dial(ctx context.Context, address string) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, address, grpc.WithInsecure(), grpc.WithBlock())
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", address, err)
	}
	return conn, nil
}

func run(ctx context.Context, o options) error {
	var conns [2]*grpc.ClientConn
	for i, address := range []string{o.registry, o.trainer} {
		conn, err := dial(ctx, address)
		if err != nil {
			return err
		}
		defer conn.Close()
		conns[i] = conn
	}
	registry := pb.NewRegistryServiceClient(conns[0])
	trainer := pb.NewTrainerServiceClient(conns[1])
	if o.sampler != "fleet" { // dialled first, so that an unreachable sampler fails before any work
		conn, err := dial(ctx, o.sampler)
		if err != nil {
			return err
		}
		conn.Close()
	}

	info, err := trainer.GetTrainerInfo(ctx, &pb.GetTrainerInfoRequest{})
	if err != nil {
		return fmt.Errorf("GetTrainerInfo: %w", err)
	}
	vocab := int64(info.GetBaseModel().GetVocabSize())
	fmt.Printf("trainer base %s vocab %d losses %v\n", info.GetBaseModel().GetArchitecture(), vocab, info.GetLossFns())

	// Watch first, so the events of everything below arrive on this stream.
	events, err := watchAdapter(ctx, registry, o.adapter)
	if err != nil {
		return err
	}

	created, err := trainer.CreateAdapter(ctx, &pb.TrainerServiceCreateAdapterRequest{
		Name:       o.adapter,
		LoraConfig: &pb.LoraConfig{Rank: 8, Alpha: 16, TargetModules: []string{"all-linear"}},
		Seed:       7,
	})
	if err != nil {
		return fmt.Errorf("CreateAdapter: %w", err)
	}
	a := created.GetAdapter()
	fmt.Printf("adapter created %s rank %d parameters %d\n", a.GetName(), a.GetLoraConfig().GetRank(), a.GetNumParameters())
	defer func() { // frees the trainer's memory; the registry keeps the adapter and its version
		cleanup, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := trainer.DeleteAdapter(cleanup, &pb.TrainerServiceDeleteAdapterRequest{Name: o.adapter}); err != nil {
			fmt.Fprintln(os.Stderr, "DeleteAdapter:", err)
		}
	}()

	version, err := trainOneStep(ctx, trainer, o.adapter, vocab)
	if err != nil {
		return err
	}
	samplerAddress := o.sampler
	if samplerAddress == "fleet" {
		if samplerAddress, err = fleetSampler(ctx, registry, o.adapter); err != nil {
			return err
		}
	}
	samplerConn, err := dial(ctx, samplerAddress)
	if err != nil {
		return err
	}
	defer samplerConn.Close()
	sampler := pb.NewSamplerServiceClient(samplerConn)
	if err := sampleVersion(ctx, sampler, fmt.Sprintf("%s@%d", o.adapter, version), vocab); err != nil {
		return err
	}
	if err := awaitPublished(ctx, events, version); err != nil {
		return err
	}
	return showErrors(ctx, registry, trainer, o.adapter)
}
