package main

import (
	"context"
	"fmt"

	"google.golang.org/protobuf/proto"

	pb "github.com/opentinker/opentinker/gen/go/opentinker/v1"
)

// sftDatum is next-token prediction over tokens: position i of the input predicts tokens[i+1].
func sftDatum(tokens []int64) *pb.Datum {
	inputs, targets := tokens[:len(tokens)-1], tokens[1:]
	weights := make([]float32, len(targets))
	for i := range weights {
		weights[i] = 1
	}
	n := []int64{int64(len(targets))}
	return &pb.Datum{
		ModelInput: &pb.ModelInput{Chunks: []*pb.ModelInputChunk{
			{Chunk: &pb.ModelInputChunk_EncodedText{EncodedText: &pb.EncodedTextChunk{Tokens: inputs}}},
		}},
		LossFnInputs: map[string]*pb.TensorData{
			"target_tokens": {Dtype: pb.DType_D_TYPE_INT64, Shape: n, Int64Values: targets},
			"weights":       {Dtype: pb.DType_D_TYPE_FLOAT32, Shape: n, Float32Values: weights},
		},
	}
}

// trainOneStep runs ForwardBackward + OptimStep on two small datums and publishes a snapshot; it returns
// the registry version number the snapshot became.
func trainOneStep(ctx context.Context, trainer pb.TrainerServiceClient, adapter string, vocab int64) (uint64, error) {
	var datums []*pb.Datum
	for d := int64(0); d < 2; d++ {
		tokens := make([]int64, 12)
		for i := range tokens {
			tokens[i] = (d*31 + int64(i)*7 + 3) % vocab
		}
		datums = append(datums, sftDatum(tokens))
	}
	fb, err := trainer.ForwardBackward(ctx, &pb.ForwardBackwardRequest{
		Adapter: adapter, Datums: datums, LossFn: "cross_entropy", TraceIds: []string{"go-example"},
	})
	if err != nil {
		return 0, fmt.Errorf("ForwardBackward: %w", err)
	}
	fmt.Printf("loss %.4f over %d datums (loss:sum) batch %s\n", fb.GetMetrics()["loss:sum"], len(datums), fb.GetBatchDigest())

	step, err := trainer.OptimStep(ctx, &pb.OptimStepRequest{
		Adapter: adapter, AdamParams: &pb.AdamParams{LearningRate: proto.Float32(1e-3)},
	})
	if err != nil {
		return 0, fmt.Errorf("OptimStep: %w", err)
	}
	fmt.Printf("step %d\n", step.GetStep())

	saved, err := trainer.SaveSnapshot(ctx, &pb.SaveSnapshotRequest{
		Adapter: adapter, Metrics: map[string]float64{"loss": fb.GetMetrics()["loss:sum"]},
	})
	if err != nil {
		return 0, fmt.Errorf("SaveSnapshot: %w", err)
	}
	v := saved.GetVersion()
	fmt.Printf("version %d of %s sha256 %s aliases %v\n", v.GetVersion(), v.GetAdapter(), v.GetArtifactSha256(), v.GetAliases())
	return v.GetVersion(), nil
}
