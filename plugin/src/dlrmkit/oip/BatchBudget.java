package dlrmkit.oip;

import java.io.File;
import java.io.IOException;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutionException;
import org.pytorch.serve.archive.model.InvalidModelException;
import org.pytorch.serve.archive.utils.ArchiveUtils;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.messages.InputParameter;
import org.pytorch.serve.util.messages.RequestInput;
import org.pytorch.serve.wlm.BatchAggregator;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.WorkerState;
import org.pytorch.serve.wlm.WorkerThread;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Batches bounded in bytes. TorchServe batches by request count (batchSize): a worker that frees
 * up takes every queued request up to batchSize, so queued large queries merge into one long
 * forward on that worker while another worker may free up a moment later with nothing left to
 * do. With this aggregator a worker's batch stops at the first queued request that would take its
 * bodies past the budget (the first request always goes, whatever its size); the rest go
 * back to the head of the model's queue, in arrival order, for the next worker that asks. Small
 * requests still merge up to batchSize (64 one-row JSON bodies are ~40 KiB). The frontend sees
 * bodies, not rows (a row is ~70-250 bytes of columns JSON, ~160-260 of OIP binary, ~640 of
 * instances JSON, counted at 40%: see size): the handler's exact row bound per forward is
 * dlrmkit.worker's MAX_ROWS_PER_FORWARD.
 *
 * <p>The budget: the model config's batchBytes (top level, beside batchSize), else
 * config.properties' dlrm_batch_bytes (read once), else DEFAULT_BYTES; 0: TorchServe's own
 * batching. Installed per worker thread by StockInference before the thread runs, for the plain
 * BatchAggregator only (sequence and continuous batching keep theirs).
 */
final class BatchBudget extends BatchAggregator {
    static final String BYTES_KEY = "dlrm_batch_bytes";
    /** The model config's own key (top level, beside batchSize; TorchServe ignores it). */
    static final String MODEL_KEY = "batchBytes";
    /**
     * About 500 rows of MLPerf-style queries as columns JSON, 800 as OIP binary tensors, three
     * 128-row ranking or instances requests, 45 one-row OIP binary requests (64 one-row JSON ones fit).
     */
    static final long DEFAULT_BYTES = 128 * 1024;
    /** A row's bytes in the other forms per its bytes as instances JSON, in percent (~260 of ~640). */
    static final int INSTANCES_SHARE_PERCENT = 40;

    private static final byte[] INSTANCES = "\"instances\"".getBytes(StandardCharsets.US_ASCII);

    private static final Logger LOG = LoggerFactory.getLogger(BatchBudget.class);
    private static final Setting BUDGET = new Setting(BYTES_KEY, DEFAULT_BYTES, "bytes");

    private final long bytes;

    private BatchBudget(Model model, long bytes) {
        super(model);
        this.bytes = bytes;
    }

    /**
     * Gives a worker thread this aggregator in place of TorchServe's plain one, before the thread
     * runs (its aggregator is read at each request: swapping one that runs would lose answers).
     */
    static void install(Runnable task) {
        if (task.getClass() != WorkerThread.class) {
            return;
        }
        try {
            Field f = WorkerThread.class.getDeclaredField("aggregator");
            f.setAccessible(true);
            Object current = f.get(task);
            if (current == null || current.getClass() != BatchAggregator.class) {
                return;
            }
            Field m = BatchAggregator.class.getDeclaredField("model");
            m.setAccessible(true);
            Model model = (Model) m.get(current);
            Long own = modelBudget(model, modelConfig(model));
            long bytes = own != null ? own : budgetBytes();
            if (bytes > 0) {
                f.set(task, new BatchBudget(model, bytes));
                String from = own != null ? MODEL_KEY : BYTES_KEY;
                LOG.info("{}: batches stop at {} bytes of bodies ({})", model.getModelName(), bytes, from);
            }
        } catch (ReflectiveOperationException | RuntimeException e) {
            LOG.warn("TorchServe's batching kept (WorkerThread.aggregator not reachable: {})", e.toString());
        }
    }

    /** The model config's batchBytes; null when it has none or a bad one (said in the log). */
    static Long modelBudget(Model model, Map<String, Object> doc) {
        Object v = doc.get(MODEL_KEY);
        if (v == null) {
            return null;
        }
        if (v instanceof Number && ((Number) v).longValue() >= 0 && ((Number) v).doubleValue() % 1 == 0) {
            return ((Number) v).longValue();
        }
        LOG.warn(
                "{}: {}: {} is not a number of bytes >= 0 (e.g. {}: {}); using {}",
                model.getModelName(),
                MODEL_KEY,
                v,
                MODEL_KEY,
                DEFAULT_BYTES,
                budgetBytes());
        return null;
    }

    /** The archive's model config file as a map (TorchServe keeps only the keys it knows). */
    private static Map<String, Object> modelConfig(Model model) {
        try {
            String name = model.getModelArchive().getManifest().getModel().getConfigFile();
            if (name != null) {
                File file = new File(model.getModelDir(), name);
                if (file.isFile()) {
                    Map<String, Object> doc = ArchiveUtils.readYamlFile(file);
                    if (doc != null) {
                        return doc;
                    }
                }
            }
        } catch (IOException | InvalidModelException | RuntimeException e) {
            LOG.warn("{}: model config not read ({}); {} applies", model.getModelName(), e.toString(), BYTES_KEY);
        }
        return Map.of();
    }

    /** dlrm_batch_bytes, read once. */
    static long budgetBytes() {
        return (long) BUDGET.get();
    }

    @Override
    public void pollBatch(String threadName, WorkerState state) throws InterruptedException, ExecutionException {
        super.pollBatch(threadName, state);
        if (jobs.size() < 2) {
            return;
        }
        List<Job> surplus = new ArrayList<>();
        long total = 0;
        Iterator<Map.Entry<String, Job>> it = jobs.entrySet().iterator();
        boolean first = true;
        while (it.hasNext()) {
            Job job = it.next().getValue();
            if (surplus.isEmpty()) {
                long size = size(job);
                if (first || total + size <= bytes) {
                    total += size;
                    first = false;
                    continue;
                }
            }
            surplus.add(job);
            it.remove();
        }
        for (int i = surplus.size() - 1; i >= 0; i--) { // the head of the queue, in arrival order
            Job job = surplus.get(i);
            try {
                model.addFirst(job);
            } catch (IllegalStateException full) { // the queue filled meanwhile: scored in this batch, never lost
                jobs.put(job.getJobId(), job);
            }
        }
    }

    /**
     * What a request counts against the budget: the bytes of its inputs (its body, for REST; its
     * tensors, for gRPC), an {@code instances} body's at INSTANCES_SHARE_PERCENT of them. That form
     * names every feature again in every row (~640 bytes a Criteo row against ~260 as columns,
     * ranking or binary), so by bytes alone a 128-row instances request would fill the budget by
     * itself and go alone, where the same rows in any other form merge two or three to a forward.
     */
    static long size(Job job) {
        RequestInput in = job.getPayload();
        long n = 0;
        if (in != null && in.getParameters() != null) {
            for (InputParameter p : in.getParameters()) {
                byte[] v = p.getValue();
                if (v != null) {
                    n += isInstances(v) ? v.length * INSTANCES_SHARE_PERCENT / 100 : v.length;
                }
            }
        }
        return n;
    }

    /** A JSON object whose first key is "instances" (whitespace allowed around the brace). */
    static boolean isInstances(byte[] body) {
        int i = skipSpace(body, 0);
        if (i >= body.length || body[i] != '{') {
            return false;
        }
        i = skipSpace(body, i + 1);
        if (body.length - i < INSTANCES.length) {
            return false;
        }
        for (int k = 0; k < INSTANCES.length; k++) {
            if (body[i + k] != INSTANCES[k]) {
                return false;
            }
        }
        return true;
    }

    private static int skipSpace(byte[] b, int i) {
        while (i < b.length && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t')) {
            i++;
        }
        return i;
    }
}
