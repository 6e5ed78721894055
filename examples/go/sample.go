package main

import (
	"context"
	"fmt"
	"io"

	"google.golang.org/protobuf/proto"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

// sampleVersion streams a greedy completion from an exact version and checks every message names it.
func sampleVersion(ctx context.Context, sampler pb.SamplerServiceClient, reference string, vocab int64) error {
	const maxTokens = 8
	prompt := []int64{1 % vocab, 5 % vocab, 9 % vocab, 13 % vocab}
	stream, err := sampler.Sample(ctx, &pb.SampleRequest{
		Model: reference,
		Prompt: &pb.ModelInput{Chunks: []*pb.ModelInputChunk{
			{Chunk: &pb.ModelInputChunk_EncodedText{EncodedText: &pb.EncodedTextChunk{Tokens: prompt}}},
		}},
		SamplingParams: &pb.SamplingParams{Temperature: proto.Float32(0), MaxTokens: maxTokens, Logprobs: true},
	})
	if err != nil {
		return fmt.Errorf("Sample: %w", err)
	}
	var tokens []int64
	var served *pb.ResolvedVersion
	stop := pb.StopReason_STOP_REASON_UNSPECIFIED
	for {
		message, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("Sample stream: %w", err)
		}
		tokens = append(tokens, message.GetTokens()...)
		served = message.GetVersion()
		if message.GetStopReason() != pb.StopReason_STOP_REASON_UNSPECIFIED {
			stop = message.GetStopReason()
		}
	}
	if served == nil {
		return fmt.Errorf("Sample %s: the stream carried no message", reference)
	}
	fmt.Printf("sampled %d tokens from %s@%d stop %s tokens %v\n",
		len(tokens), served.GetAdapter(), served.GetVersion(), stop, tokens)
	return nil
}
